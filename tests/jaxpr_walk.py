"""The equations of a traced function, nested jaxprs included (pallas_call bodies, jit,
cond branches): what a test reads to check which kernels and dots a function runs."""

import jax
import jax.extend


def equations(fn, *args, primitive: str) -> list:
    """Every equation of `primitive` (its name, e.g. "pallas_call") in fn's jaxpr on
    `args`, in trace order, nested jaxprs walked depth first."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
