"""The host side's logic, pure Python + numpy, never jax: requests (sequence, sampling
parameters, outputs), the block manager, the prefix cache (trie + pool), the scheduler
and its policies, and cascade planning."""
