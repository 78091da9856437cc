"""The device side: packing a scheduled step into arrays (input_batch), the model runner
(weights, KV cache, launch and fetch), the jitted step and its sampler, tensor
parallelism, and the XLA flags the step compiles with."""
