"""`jprefix bench throughput | latency | serve` (vLLM's `vllm bench` with its flag names)
and the helpers the device-side tools in scripts/ share.

- `throughput.py`, `latency.py`: offline, the engine in this process;
- `serve.py` (with `serve_client.py`): a running OpenAI-compatible server over HTTP;
- `workload.py` (dataset flags), `datasets.py` (synthetic and random prompts, request
  files), `sharegpt.py`: the requests; `arrivals.py`: when they are sent;
- `metrics.py`: latency statistics; `common.py`: JSON, tables, engine-benchmark flags.

Nothing here is imported by the engine (jprefix.core / engine / worker).
"""
