"""The benchmarks and tools a user runs (each `PYTHONPATH=$PWD python scripts/<name>.py`).

A regular package, so `from scripts.<name> import ...` finds this folder first on the path
(the repository root) rather than any installed distribution's top-level `scripts`."""
