"""The device-side and kernel tools (the user-facing benchmarks are `jprefix bench`, in
jprefix/benchmarks/). Each runs as `python scripts/<name>.py` from the repository root, no
PYTHONPATH needed: run as a script, it puts its checkout first on sys.path.

A regular package, so `from scripts.<name> import ...` finds this folder first on the path
(the repository root) rather than any installed distribution's top-level `scripts`."""
