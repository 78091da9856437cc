"""One-off investigations (README.md: the question each answered); run as
`PYTHONPATH=$PWD python scripts/probes/<name>.py`."""
