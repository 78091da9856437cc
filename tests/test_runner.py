"""The jitted step donates the KV cache and updates it in place (no per-step copy); the
runner's compile options; a repeated workload compiles nothing new."""

import pytest

import jprefix
from jprefix import LLM
from scripts.memcheck import step_memory_report


def test_step_updates_kv_cache_in_place():
    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=4096)  # cache far larger than anything else
    report = step_memory_report(llm.engine.runner)
    assert report["alias_bytes"] == report["kv_bytes"]  # both K and V buffers are reused
    assert report["temp_bytes"] < report["kv_bytes"] // 8  # no scratch copy of the cache


def test_unrolled_layers_match_scanned_layers_and_stay_in_place():
    import numpy as np

    from jprefix import SamplingParams

    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    prompts = [np.random.default_rng(i).integers(3, 200, 13 + i).tolist() for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for unroll in (False, True):
        llm = LLM(tiny, block_size=8, num_kv_blocks=64, unroll_layers=unroll)
        assert isinstance(llm.engine.runner.params.layers, tuple) == unroll
        outs[unroll] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[True] == outs[False]
    report = step_memory_report(llm.engine.runner)
    assert report["alias_bytes"] == report["kv_bytes"]


def test_llm_that_loads_its_model_keeps_one_copy_of_the_weights():
    """The step's layout (per-layer, fused) replaces the loaded one, so the engine's model
    and the runner hold the same buffers; a model passed in by the caller is left as is."""
    import jax

    llm = LLM("tiny-llama3", dtype="float32", load_format="dummy", block_size=8,
              num_kv_blocks=32, unroll_layers=True)
    held = jax.tree_util.tree_leaves(llm.engine.model.params)
    used = jax.tree_util.tree_leaves(llm.engine.runner.params)
    assert isinstance(llm.engine.model.params.layers, tuple)
    assert len(held) == len(used) and all(a is b for a, b in zip(held, used, strict=True))
    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    stacked = tiny.params
    llm = LLM(tiny, block_size=8, num_kv_blocks=32, unroll_layers=True)
    assert tiny.params is stacked and not isinstance(tiny.params.layers, tuple)
    assert isinstance(llm.engine.runner.params.layers, tuple)


def test_a_failed_launch_fails_every_later_step_clearly(monkeypatch):
    """After a step raises on the launch thread, later steps refuse with a clear error
    instead of running on a consumed cache and stale pending tokens."""
    import pytest

    from jprefix import SamplingParams
    from scripts.memcheck import synthetic_rows

    tiny = jprefix.load("tiny-llama", dtype="float32", load_format="dummy")
    llm = LLM(tiny, block_size=8, num_kv_blocks=32)

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    monkeypatch.setattr(llm.engine.runner, "_step", broken)  # (its compiled step)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="earlier engine step failed"):
        llm.engine.runner.execute(synthetic_rows([[5, 6, 7]], [[1]], [3]))


def test_mixed_step_gives_each_row_its_token_in_any_row_order(sharp_tiny):
    """A step of prefill chunks and decodes in any order: the runner moves the one-token
    rows first (decode tiling for them), and each row still gets its own token, equal
    to the XLA backend's (the same rows, the same zero cache)."""
    from scripts.memcheck import synthetic_rows

    tiny = sharp_tiny
    contexts = [list(range(3 + 7 * n, 3 + 8 * n)) for n in (12, 9, 20, 5)]
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(4)]
    num_new = [6, 1, 8, 1]  # chunk, decode, chunk, decode
    tokens = {}
    for backend in ("xla", "pallas-interpret"):
        for flip in (False, True):
            llm = LLM(tiny, block_size=8, num_kv_blocks=32, attention_backend=backend)
            order = [3, 2, 1, 0] if flip else [0, 1, 2, 3]
            rows = synthetic_rows([contexts[i] for i in order], [tables[i] for i in order],
                                  [num_new[i] for i in order])
            got = llm.engine.runner.execute(rows).tolist()
            tokens[backend, flip] = [got[order.index(i)] for i in range(4)]
            assert any(mixed for *_, mixed in llm.engine.runner.shapes_seen)
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


def test_fixed_inputs_refill_the_same_device_buffers_and_change_no_token(sharp_tiny):
    """With `fixed_inputs` each step's packed buffers are copied into device buffers that
    keep their address (what lets XLA replay a recorded command buffer): the tokens
    equal those of fresh input buffers, one buffer serves each shape, and a second run of
    the same steps refills the very same buffers."""
    import numpy as np

    from jprefix import SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, n).tolist() for n in (13, 30, 7, 22)]
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True)]
    outs = {}
    for fixed in (False, True):
        llm = LLM(sharp_tiny, block_size=8, num_kv_blocks=64, fixed_inputs=fixed,
                  max_num_batched_tokens=32)  # chunked prefill mixes with decodes
        runner = llm.engine.runner
        assert (runner.fixed_inputs is not None) == fixed
        outs[fixed] = [o.token_ids for o in llm.generate(prompts, sps * 2, use_tqdm=False)]
    buffers = dict(runner.fixed_inputs._buffers)
    assert len(buffers) >= 2  # (prefill and decode steps pack to different sizes)
    pointers = {k: b.unsafe_buffer_pointer() for k, b in buffers.items()}
    llm.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(prompts, sps * 2, use_tqdm=False)] == outs[True]
    assert all(b.is_deleted() for b in buffers.values())  # donated to the refill
    again = runner.fixed_inputs._buffers
    assert set(again) == set(buffers)
    assert {k: b.unsafe_buffer_pointer() for k, b in again.items()} == pointers
    assert outs[True] == outs[False]


def test_step_options_disable_rematerialization_and_keep_passes_already_disabled():
    """The step's XLA options turn the rematerialization pass off (it recomputed matmuls
    of the H200's 7B steps), keep any pass that XLA_FLAGS already disables (the option
    replaces the flag's list), and leave XLA's default when asked to."""
    from jprefix.worker.xla_flags import step_compiler_options

    assert step_compiler_options("") == {"xla_disable_hlo_passes": "rematerialization"}
    flags = "--xla_gpu_enable_command_buffer= --xla_disable_hlo_passes=foo,rematerialization,bar"
    assert step_compiler_options(flags) == {"xla_disable_hlo_passes": "rematerialization,foo,bar"}
    assert step_compiler_options(flags, keep_remat=True) == {}


def test_fp8_weight_steps_turn_xla_triton_gemms_off_unless_told(monkeypatch):
    """A step over fp8 weights compiles with XLA's Triton GEMM emitter off (its per-fusion
    autotuning kept a 7B engine compiling for minutes), unless XLA_FLAGS sets the flag or
    JPREFIX_XLA_TRITON_GEMM=1; other steps keep XLA's default."""
    from jprefix.worker.step import compiled_steps, step, step_logits
    from jprefix.worker.xla_flags import step_compiler_options

    monkeypatch.delenv("JPREFIX_XLA_TRITON_GEMM", raising=False)
    assert step_compiler_options("", fp8_weights=True) == {
        "xla_disable_hlo_passes": "rematerialization", "xla_gpu_enable_triton_gemm": False}
    assert step_compiler_options("", keep_remat=True, fp8_weights=True) == {
        "xla_gpu_enable_triton_gemm": False}
    assert "xla_gpu_enable_triton_gemm" not in step_compiler_options("")
    assert "xla_gpu_enable_triton_gemm" not in step_compiler_options(
        "--xla_gpu_enable_triton_gemm=true", fp8_weights=True)
    monkeypatch.setenv("JPREFIX_XLA_TRITON_GEMM", "1")
    assert "xla_gpu_enable_triton_gemm" not in step_compiler_options("", fp8_weights=True)
    assert compiled_steps(False) == (step, step_logits)
    fp8_steps = compiled_steps(True)
    assert fp8_steps is compiled_steps(True) and set(fp8_steps).isdisjoint({step, step_logits})


@pytest.mark.parametrize("fixed_inputs", [False, True])
def test_a_repeated_workload_compiles_no_new_step(caplog, fixed_inputs):
    """The KV cache and the pending-token buffer start committed to the runner's device,
    as every step's outputs are once the weights are (the GPU's are, after their layout
    is compacted), so the first step's compile serves its shape later too. (Created
    uncommitted, they gave the first step a compile of its own and the same shape a
    second one once the cache came out of a step: seconds of stall at 7B.)"""
    import dataclasses
    import logging

    import jax
    import numpy as np

    from jprefix import SamplingParams

    tiny = jprefix.load("tiny-llama3", dtype="float32", load_format="dummy")
    tiny = dataclasses.replace(tiny, params=jax.device_put(tiny.params, jax.devices()[0]))
    llm = LLM(tiny, block_size=8, num_kv_blocks=64, fixed_inputs=fixed_inputs)
    prompts = [np.random.default_rng(i).integers(3, 200, 21).tolist() for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.reset_prefix_cache()
    # (the global flag, not the thread-local context: steps compile on the launch thread)
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            again = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        jax.config.update("jax_log_compiles", was)
    assert again == first
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [m for m in compiles if m.startswith("Compiling jit(step")], compiles
