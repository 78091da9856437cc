"""What users call: `LLM` and `generate`, the asyncio driver behind `generate_async`,
the `jprefix` command line, and the OpenAI-compatible server."""
