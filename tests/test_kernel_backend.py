"""pallas_kernels.backend: the per-kernel, per-shape backend table and its override, and
the routing of the engine's prefill attention to the Mosaic GPU kernel."""

import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels.backend import Rule, choose, parse_override, table_choice

TABLE = (Rule("fp8_matmul", 128, 8192, "mosaic"),
         Rule("attention", 0, 4096, "triton"))


@pytest.fixture(autouse=True)
def two_kernels(monkeypatch):
    """A second kernel name beside the one with a Mosaic version, for the per-kernel
    override and the table's per-kernel rules."""
    monkeypatch.setattr(backend, "KERNELS", ("fp8_matmul", "prefill_attention", "attention"))


@pytest.mark.parametrize("rows,want", [(0, "triton"), (16, "triton"), (127, "triton"),
                                       (128, "mosaic"), (4096, "mosaic"),
                                       (8192, "mosaic"), (8193, "triton")])
def test_table_ranges(rows, want):
    assert table_choice("fp8_matmul", rows, TABLE) == want
    assert choose("fp8_matmul", rows, table=TABLE, env="") == want


def test_unlisted_kernel_runs_triton():
    assert choose("attention", 8192, table=TABLE, env="") == "triton"
    assert choose("attention", 10, table=(), env="") == "triton"


@pytest.mark.parametrize("value", ["triton", "mosaic"])
def test_override_forces_every_kernel(value):
    for kernel in backend.KERNELS:
        for rows in (1, 128, 8192):
            assert choose(kernel, rows, table=TABLE, env=value) == value


def test_override_per_kernel():
    env = "attention=mosaic"
    assert choose("attention", 100, table=TABLE, env=env) == "mosaic"
    assert choose("fp8_matmul", 16, table=TABLE, env=env) == "triton"  # the table's
    assert choose("fp8_matmul", 256, table=TABLE, env=env) == "mosaic"
    env = "fp8_matmul=triton, attention=mosaic"
    assert parse_override(env) == {"fp8_matmul": "triton", "attention": "mosaic"}
    assert choose("fp8_matmul", 256, table=TABLE, env=env) == "triton"


def test_mosaic_only_where_the_kernel_takes_the_shape():
    assert choose("fp8_matmul", 256, table=TABLE, env="", mosaic_ok=False) == "triton"
    assert choose("fp8_matmul", 256, table=TABLE, env="mosaic", mosaic_ok=False) == "triton"


def test_reads_the_environment(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "mosaic")
    assert choose("fp8_matmul", 1, table=()) == "mosaic"
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert choose("fp8_matmul", 256, table=TABLE) == "triton"
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert choose("fp8_matmul", 256, table=TABLE) == "mosaic"


@pytest.mark.parametrize("value", ["cuda", "fp8_matmul=cuda", "matmul=mosaic",
                                   "fp8_matmul", "mosaic,triton"])
def test_bad_override_is_refused_by_name(value):
    with pytest.raises(ValueError, match=backend.ENV_VAR):
        choose("fp8_matmul", 16, env=value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'matmul'"):
        table_choice("matmul", 16)
    with pytest.raises(ValueError, match="rows -1"):
        table_choice("fp8_matmul", -1)


@pytest.mark.parametrize("table", [
    (Rule("fp8_matmul", 0, 10, "cuda"),),
    (Rule("decode", 0, 10, "mosaic"),),
    (Rule("fp8_matmul", 10, 5, "mosaic"),),
    (Rule("fp8_matmul", 0, 128, "mosaic"), Rule("fp8_matmul", 128, 256, "triton")),
    (Rule("fp8_matmul", 0, 128, "mosaic", n=64), Rule("fp8_matmul", 0, 16, "triton", k=8)),
])
def test_table_check_refuses_bad_tables(table):
    with pytest.raises(ValueError):
        backend._check_table(table)


def test_shape_rules():
    table = (Rule("fp8_matmul", 4096, 4096, "mosaic", k=4096, n=4096),
             Rule("fp8_matmul", 4096, 4096, "triton", k=4096, n=12288))
    backend._check_table(table)
    assert choose("fp8_matmul", 4096, k=4096, n=4096, table=table, env="") == "mosaic"
    assert choose("fp8_matmul", 4096, k=4096, n=12288, table=table, env="") == "triton"
    assert choose("fp8_matmul", 4096, k=11008, n=4096, table=table, env="") == "triton"
    assert choose("fp8_matmul", 2048, k=4096, n=4096, table=table, env="") == "triton"
    assert choose("fp8_matmul", 4096, k=4096, n=4096, table=table, env="triton") == "triton"
    with pytest.raises(ValueError, match="overlap"):
        backend._check_table(table + (Rule("fp8_matmul", 0, 8192, "triton", n=4096),))


def test_shipped_table():
    """The measured win: Llama-2-7B's o projection (4096 x 4096) at 4,096 rows."""
    assert choose("fp8_matmul", 4096, k=4096, n=4096, env="") == "mosaic"
    assert choose("fp8_matmul", 4096, k=4096, n=12288, env="") == "triton"
    assert choose("fp8_matmul", 256, k=4096, n=4096, env="") == "triton"
    assert choose("fp8_matmul", 4096, k=4096, n=4096, env="", mosaic_ok=False) == "triton"


def test_shipped_table_is_valid():
    backend._check_table(backend.TABLE)
    backend._check_table(TABLE)


def test_fp8_matmul_mosaic_declines_off_hopper(monkeypatch):
    """Without a Hopper GPU (pretended absent where there is one) the engine's fp8
    matmuls never take the Mosaic path, even when the override forces it:
    fp8_matmul_mosaic answers None."""
    import jax.numpy as jnp

    monkeypatch.setenv(backend.ENV_VAR, "mosaic")
    monkeypatch.setattr(backend, "mosaic_available", lambda: False)
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    w8 = jnp.ones((4096, 4096), jnp.float8_e4m3fn)
    assert backend.fp8_matmul_mosaic(x, w8, jnp.ones(4096), lambda x: 1 / 0) is None


def test_fp8_matmul_mosaic_routes_where_the_table_says(monkeypatch):
    """With a Hopper GPU (pretended), the table's shape goes to the Mosaic kernel with
    the activations quantised by the injected function; other shapes and a float32 x
    stay on today's path (None)."""
    import jax.numpy as jnp

    pytest.importorskip("absl", reason="Mosaic GPU's Python package imports absl")
    from pallas_kernels import mgpu_fp8_matmul as mgpu

    calls = []
    monkeypatch.setattr(backend, "mosaic_available", lambda: True)
    monkeypatch.setattr(mgpu, "mgpu_fp8_matmul", lambda *a, **kw: calls.append((a, kw)) or 7)
    monkeypatch.delenv(backend.ENV_VAR, raising=False)

    def quantize(x):
        return x.astype(jnp.float8_e4m3fn), jnp.full((x.shape[0], 1), 2.0)

    w8, ws = jnp.ones((4096, 4096), jnp.float8_e4m3fn), jnp.ones(4096)
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    assert backend.fp8_matmul_mosaic(x, w8, ws, quantize) == 7
    (args, kw), = calls
    assert args[0].dtype == jnp.float8_e4m3fn and kw["quant"] == "pre"
    assert kw["x_scale"].shape == (4096,) and float(kw["x_scale"][0]) == 2.0
    assert kw["config"] == mgpu.ENGINE_CONFIG
    assert backend.fp8_matmul_mosaic(x[:256], w8, ws, quantize) is None
    assert backend.fp8_matmul_mosaic(x.astype(jnp.float32), w8, ws, quantize) is None
    assert backend.fp8_matmul_mosaic(x[:, :1024], w8[:, :1024], ws, quantize) is None
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.fp8_matmul_mosaic(x, w8, ws, quantize) is None
    assert len(calls) == 1


def test_prefill_attention_table_and_override():
    """The table: Mosaic from 4,096 rows (where an H200 measured it faster), Triton
    below and wherever the kernel cannot run; the override (all kernels, or this one by
    name) forces either where the kernel can run."""
    for rows in (1, 128, 2048, 4095):
        assert choose("prefill_attention", rows, env="") == "triton"
    for rows in (4096, 6656, 16384):
        assert choose("prefill_attention", rows, env="") == "mosaic"
        assert choose("prefill_attention", rows, env="", mosaic_ok=False) == "triton"
        assert choose("prefill_attention", rows, env="prefill_attention=triton") == "triton"
    assert choose("prefill_attention", 2048, env="mosaic") == "mosaic"
    assert choose("prefill_attention", 2048, env="prefill_attention=mosaic") == "mosaic"
    assert choose("prefill_attention", 2048, env="fp8_matmul=mosaic") == "triton"
    assert choose("prefill_attention", 2048, env="mosaic", mosaic_ok=False) == "triton"


def _attention_batch(seqs, dtype=None):
    import jax.numpy as jnp
    import numpy as np
    from test_paged_attention import make_batch

    return make_batch(np.random.default_rng(0), seqs, heads=4, kv_heads=2, head_dim=128,
                      block_size=16, dtype=dtype or jnp.bfloat16)


def test_prefill_attention_mosaic_declines_off_hopper(monkeypatch):
    """As the fp8 matmul's: no Hopper GPU (pretended absent where there is one), no
    Mosaic prefill attention, whatever the override says."""
    monkeypatch.setenv(backend.ENV_VAR, "mosaic")
    monkeypatch.setattr(backend, "mosaic_available", lambda: False)
    b = _attention_batch([(5, 20)])
    assert backend.prefill_attention_mosaic(**b, scale=0.1) is None


@pytest.fixture
def pretend_hopper(monkeypatch):
    """A Hopper GPU pretended: the Mosaic kernel and the Triton kernel replaced by the
    reference (each call recorded), so the routing and the mixed-step composition run
    on the CPU."""
    pytest.importorskip("absl", reason="Mosaic GPU's Python package imports absl")
    from pallas_kernels import mgpu_paged_prefill as mgpu
    from pallas_kernels import paged_attention as pa

    calls = []

    def fake(name):
        def run(*args, scale, alibi_slopes=None, **kw):
            calls.append((name, kw))
            return pa.paged_attention_reference(*args, scale=scale, alibi_slopes=alibi_slopes)
        return run

    monkeypatch.setattr(backend, "mosaic_available", lambda: True)
    monkeypatch.setattr(mgpu, "mgpu_paged_prefill", fake("mosaic"))
    monkeypatch.setattr(pa, "paged_attention", fake("triton"))
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    return calls


def test_prefill_attention_mosaic_routes_where_the_table_or_override_says(
        pretend_hopper, monkeypatch):
    import jax.numpy as jnp

    b = _attention_batch([(5, 20), (17, 17)])
    assert backend.prefill_attention_mosaic(**b, scale=0.1) is None  # 22 rows: Triton
    monkeypatch.setenv(backend.ENV_VAR, "prefill_attention=mosaic")
    out = backend.prefill_attention_mosaic(**b, scale=0.1)
    assert out is not None and [c[0] for c in pretend_hopper] == ["mosaic"]
    f32 = _attention_batch([(5, 20)], jnp.float32)
    assert backend.prefill_attention_mosaic(**f32, scale=0.1) is None
    refused = [dict(k_scale=b["k_cache"][..., 0]), dict(sliding_window=4)]
    for kw in refused:  # an fp8 cache, a window: the kernel's refusals keep Triton
        assert backend.prefill_attention_mosaic(**b, scale=0.1, **kw) is None
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.prefill_attention_mosaic(**b, scale=0.1) is None
    assert len(pretend_hopper) == 1
    monkeypatch.delenv(backend.ENV_VAR)
    # the table's Mosaic rows, unforced (short sequences: the reference standing in for
    # the kernel answers 4,096 rows of 16 keys at once, not of 4,100: ~35 s on a CPU)
    big = _attention_batch([(16, 16)] * 256)
    assert backend.prefill_attention_mosaic(**big, scale=0.1) is not None
    assert [c[0] for c in pretend_hopper] == ["mosaic", "mosaic"]


@pytest.mark.parametrize("num_decode", [0, 2, 3])
def test_prefill_attention_mosaic_mixed_step(pretend_hopper, monkeypatch, num_decode):
    """A mixed step (its first num_decode sequences one-row decodes): decode rows by the
    Triton decode tiling, the rest by the Mosaic kernel, together the reference."""
    import jax.numpy as jnp
    import numpy as np
    from test_paged_attention import rel_err

    from pallas_kernels.paged_attention import paged_attention_reference

    monkeypatch.setenv(backend.ENV_VAR, "mosaic")
    b = _attention_batch([(1, 37), (1, 5), (1, 16), (12, 30), (7, 7)])
    out = backend.prefill_attention_mosaic(**b, scale=0.1, num_decode=jnp.int32(num_decode))
    ref = paged_attention_reference(**b, scale=0.1)
    n = int(b["cu_q_lens"][-1])
    assert rel_err(np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]) < 1e-6
    assert [c[0] for c in pretend_hopper] == ["triton", "mosaic"]
    assert pretend_hopper[0][1] == {"max_q_len": 1}


def test_step_attention_runs_the_chosen_kernel(monkeypatch):
    """The engine's attention (`worker.step._attention`, Pallas backend) returns the
    Mosaic kernel's output for a prefill or mixed step where it answers, and never asks
    it for decode steps."""
    from jprefix.worker import step

    asked = []
    monkeypatch.setattr(backend, "prefill_attention_mosaic",
                        lambda *a, **kw: asked.append(kw["num_decode"]) or "mosaic")
    monkeypatch.setattr(step, "paged_attention", lambda *a, **kw: "triton")
    b = _attention_batch([(5, 20)])
    cache, q = (b["k_cache"], b["v_cache"]), b["q"]
    batch = {k: b[k] for k in ("block_tables", "kv_lens", "cu_q_lens")}
    assert step._attention("pallas", False, False, q, cache, b["layer"], batch, 0.1) == "mosaic"
    assert step._attention("pallas", True, False, q, cache, b["layer"], batch, 0.1) == "triton"
    mixed = dict(batch, num_decode=np.array([1], np.int32))
    assert step._attention("pallas", False, False, q, cache, b["layer"], mixed, 0.1) == "mosaic"
    assert asked[0] is None and int(asked[1]) == 1
