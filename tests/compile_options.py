"""The suite's XLA compile options on a machine without a GPU (conftest.py applies them).

Most of a CPU test's time is XLA compiling engine steps and interpret-mode kernels, each
run a few times on tiny shapes (about 3/4 of tests/test_engine.py): with LLVM's
optimisations off they compile 20-25% faster, and the results are IEEE the same (tests
compare programs compiled alike). A test whose time is running real model shapes instead
(SmolLM2's float32 forwards over 2,048 tokens) runs slower at -O0: it jits that work with
`FULL_OPT`, which restores XLA's default for one program.
"""

CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
FULL_OPT = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}

