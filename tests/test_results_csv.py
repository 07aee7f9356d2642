"""scripts/results_csv.py: every published bench run as rows of one CSV."""

import csv
import json

from tests.scripts import ROOT, run_script


def test_every_row_of_every_bench_file(tmp_path):
    results = ROOT / "benchmarks" / "results"
    out = tmp_path / "results.csv"
    result = run_script("results_csv.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(out.open()))
    files = sorted(results.rglob("bench*.json"))
    assert len(rows) == sum(len(json.loads(f.read_text())["rows"]) for f in files) and files
    one = json.loads((results / "h100/release_range_2026-11-26/bench_triton39.json").read_text())
    mine = [r for r in rows if r["file"] == "results/h100/release_range_2026-11-26/bench_triton39.json"]
    assert [(int(r["batch"]), r["system"], float(r["ms"])) for r in mine] == \
        [(r["batch"], r["system"], round(r["ms"], 4)) for r in one["rows"]]
    assert {(r["gpu"], r["torch"], r["triton"], r["dtype"], r["date"]) for r in mine} == \
        {("NVIDIA H100 80GB HBM3", "2.11.0+cu130", "3.9.0", "bfloat16", "2026-11-26")}
