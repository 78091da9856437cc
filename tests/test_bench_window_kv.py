"""scripts/bench_window_kv.py's CPU smoke run (--tiny): both modes finish the shared-
document workload, and the hybrid cache holds less KV memory than one table."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_window_kv.py"


def test_tiny_run_reports_both_modes(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_window_kv", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "window_kv.json"
    bench.main(["--tiny", "--output-json", str(out)])
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    hybrid, one = rows["hybrid"], rows["one_table"]
    assert hybrid["output_tokens"] == one["output_tokens"] == 6 * 24
    assert hybrid["hit_rate"] > 0.9 and one["hit_rate"] > 0.9  # the document is hit
    assert hybrid["kv_mib_peak"] < one["kv_mib_peak"]
