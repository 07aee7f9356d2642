"""Every published `vit-triton bench` run as rows of one table: benchmarks/results.csv.

One row a system and batch size of each bench*.json under benchmarks/results/: GPU, date, the commit that added
the file, torch and Triton versions, model, dtype (tf32 for float32 run with tf32 matmuls), batch, system, the
median ms and images/s, and the file. Run it after committing new results, and commit the table it writes.

    python scripts/results_csv.py [--results benchmarks/results] [--out benchmarks/results.csv]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vit_triton.utils import write_atomic  # noqa: E402

COLUMNS = ("gpu", "date", "commit", "torch", "triton", "model", "dtype", "batch", "system", "ms", "images_per_s",
           "file")


def added_in(path: Path) -> str:
    """The short hash of the commit that added `path`; empty for a file not committed yet."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip()


def rows_of(path: Path, root: Path) -> list[dict]:
    run = json.loads(path.read_text())
    env = run["environment"]
    tf32 = run["dtype"] == "float32" and run.get("float32_matmul_precision", "highest") != "highest"
    common = dict(gpu=env["gpu"], date=env["date"][:10], commit=added_in(path), torch=env["torch"],
                  triton=env["triton"], model=run["model"], dtype="tf32" if tf32 else run["dtype"],
                  file=str(path.relative_to(root.parent)))
    return [dict(common, batch=row["batch"], system=row["system"], ms=f"{row['ms']:.4f}",
                 images_per_s=f"{row['images_per_s']:.1f}") for row in run["rows"]]


def table(results: Path) -> list[dict]:
    """Rows of every bench*.json under `results`, oldest run first."""
    rows = [row for path in sorted(results.rglob("bench*.json")) for row in rows_of(path, results)]
    return sorted(rows, key=lambda r: (r["date"], r["file"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results.csv")
    args = parser.parse_args()
    text = io.StringIO()
    writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
    writer.writeheader()
    rows = table(args.results)
    writer.writerows(rows)
    write_atomic(args.out, lambda f: f.write(text.getvalue().encode()))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
