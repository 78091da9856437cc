"""The docs keep to their rules: every file in docs/results is cited by name in a doc
(uncited results are deleted), and docs/PERF.md stays a page of current figures."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_result_file_is_cited_by_name():
    docs = "".join(p.read_text(encoding="utf-8")
                   for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    results = sorted(p.name for p in (ROOT / "docs" / "results").iterdir())
    assert results
    assert [name for name in results if name not in docs] == []


def test_perf_stays_under_400_lines():
    assert len((ROOT / "docs" / "PERF.md").read_text(encoding="utf-8").splitlines()) <= 400
