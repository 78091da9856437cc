"""HostRows (the host tier's storage): chunked rows, pinned or NumPy, equal a plain
array under random reads and writes, including rows of chunks allocated on first use."""

import jax
import numpy as np
import pytest

from jprefix.worker.host_rows import HostRows, pinned_works


def _pinned():
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return s.with_memory_kind("pinned_host"), s


@pytest.mark.parametrize("pinned", [True, False])
def test_random_reads_and_writes_equal_a_plain_array(pinned):
    host, device = _pinned()
    assert pinned_works(host, device)
    row_shape, n = (3, 2, 5), 23
    rows = HostRows(n, row_shape, np.float32, host if pinned else None,
                    chunk_bytes=4 * 30 * 4)  # 4 rows a chunk: 6 chunks, the last short
    assert rows.per_chunk == 4 and len(rows) == n and rows.nbytes == n * 30 * 4
    ref = np.zeros((n, *row_shape), np.float32)
    rng = np.random.default_rng(0)
    for _ in range(30):
        slots = rng.choice(n, rng.integers(1, 12), replace=False)
        data = rng.standard_normal((len(slots), *row_shape)).astype(np.float32)
        rows.write_from(slots, data)
        ref[slots] = data
        probe = rng.integers(0, n, 9)
        np.testing.assert_array_equal(rows.rows(probe), ref[probe])
    out = np.full((n + 3, *row_shape), np.nan, np.float32)  # padding rows stay untouched
    rows.read_into(np.arange(n), out)
    np.testing.assert_array_equal(out[:n], ref)
    assert np.isnan(out[n:]).all()


def test_a_pinned_chunk_is_what_the_device_reads():
    """A write through the view reaches the device through the pinned array."""
    host, device = _pinned()
    rows = HostRows(8, (4,), np.float32, host)
    rows.write_from(np.array([5]), np.full((1, 4), 3.0, np.float32))
    arr = rows.chunk_array(0)
    np.testing.assert_array_equal(np.asarray(jax.device_put(arr, device))[5], 3.0)
