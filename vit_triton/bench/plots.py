"""The bench's PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from ..utils import require

require("matplotlib", "bench", "vit-triton bench's plots").use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_throughput(result: dict, path: Path) -> None:
    """Images/s against batch size, one line per system."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r["system"] for r in result["rows"]):
        pts = sorted((r["batch"], r["images_per_s"]) for r in result["rows"] if r["system"] == system and "ms" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=system, linewidth=2.5 if system == "vit-triton" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("images / s")
    ax.set_title(f"{result['model']} {result['dtype']} on {result['environment']['gpu']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_roofline(result: dict, path: Path) -> None:
    """Log-log roofline: both ceilings, one point per kernel for vit-triton and for PyTorch."""
    peak, bw = result["ceilings"]["matmul_tflops"], result["ceilings"]["copy_gbps"] / 1e3  # TFLOP/s, TB/s
    rows = result["kernels"]
    lo = min(r["intensity"] for r in rows) / 2
    hi = max(max(r["intensity"] for r in rows) * 2, peak / bw * 4)
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [lo, peak / bw, hi]
    ax.plot(xs, [min(peak, x * bw) for x in xs], color="black", linewidth=1.5, label="roofline (measured)")
    for who, marker in (("ours", "o"), ("torch", "x")):
        for r in rows:
            ax.scatter(r["intensity"], r[f"{who}_tflops"], marker=marker, s=40,
                       color="tab:blue" if who == "ours" else "tab:red")
            if who == "ours":
                ax.annotate(r["name"], (r["intensity"], r["ours_tflops"]), fontsize=7, xytext=(4, 3),
                            textcoords="offset points")
    ax.scatter([], [], marker="o", color="tab:blue", label="vit-triton")
    ax.scatter([], [], marker="x", color="tab:red", label="PyTorch")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{result['model']} batch {result['batch']} {result['dtype']} on {result['environment']['gpu']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
