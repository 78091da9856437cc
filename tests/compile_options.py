"""The suite's XLA compile options on a machine without a GPU (conftest.py applies them).

Most of a CPU test's time is XLA compiling engine steps and interpret-mode kernels, each
run a few times on tiny shapes (about 3/4 of tests/test_engine.py): with LLVM's
optimisations off they compile 20-25% faster, and the results are IEEE the same (tests
compare programs compiled alike). A test whose time is running real model shapes instead
(SmolLM2's float32 forwards over 2,048 tokens) runs slower at -O0: it jits that work with
`FULL_OPT`, which restores XLA's default for one program.
"""

import contextlib

CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
FULL_OPT = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}


@contextlib.contextmanager
def full_opt_engine_steps():
    """Engines built inside run their steps (`jprefix.worker.step`'s `step` and
    `step_logits`) compiled at XLA's default level: a module of real-model engine tests
    spends its time running SmolLM2's steps rather than compiling them, and -O0 slows
    those down. Module-wide: an engine keeps the step it was built with."""
    from jprefix.worker import step as s

    saved = s.step, s.step_logits
    s.step = s._jit_step(saved[0].__wrapped__, s._STEP_STATIC, extra_options=FULL_OPT)
    s.step_logits = s._jit_step(saved[1].__wrapped__, s._STATIC, extra_options=FULL_OPT)
    s.compiled_steps.cache_clear()
    try:
        yield
    finally:
        s.step, s.step_logits = saved
        s.compiled_steps.cache_clear()
