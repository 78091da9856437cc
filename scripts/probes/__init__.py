"""One-off investigations (README.md: the question each answered); run as
`python scripts/probes/<name>.py`."""
