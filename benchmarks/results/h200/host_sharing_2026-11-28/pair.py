"""At G GPUs with 15 workers a rank: G independent single-GPU embeds at once (CUDA_VISIBLE_DEVICES=i, disjoint
parts) against torchrun over G, and one alone; images/s a GPU (whole run, from embed's own line). PAIR_ROUNDS: e.g.
"one,independent,torchrun" or "independent:main,independent:nice" (a tree of PAIR_TREES)."""
import json, os, re, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]   # the checkout
sys.path.insert(0, str(ROOT / "scripts")); sys.path.insert(0, str(ROOT))
from embed_throughput import make_images, make_checkpoint, read_all
import torch
G = torch.cuda.device_count()
root = Path("/tmp/ce"); per = int(os.environ.get("PAIR_PER", "100000"))
paths = make_images(root / "images", G * per, distinct=20000)
read_all(paths[:20000])
ck = make_checkpoint(root / "vitb")
for i in range(G):
    (root / f"part{i}.txt").write_text("\n".join(paths[i * per:(i + 1) * per]) + "\n")
(root / "all.txt").write_text("\n".join(paths[:G * per]) + "\n")
(root / "warm.txt").write_text("\n".join(paths[:1024]) + "\n")
DONE = re.compile(r"this run: (\d+) images in ([\d.]+) s")
def cmd(lst, out, extra=()):
    return [sys.executable, "-m", "vit_triton", "embed", str(lst), "--model", str(ck), "--output", str(out),
            "--overwrite", "--no-progress", "--num-workers", "15", *extra]
def rate(text):
    m = DONE.search(text)
    return round(int(m.group(1)) / float(m.group(2))) if m else text[-400:]
subprocess.run(cmd(root / "warm.txt", root / "warm.parquet"), check=True, capture_output=True)
out = []
# PAIR_TREES: name=path of other checkouts (this one with worker_nice.diff or jpeg_one_copy.diff applied)
TREES = {"main": str(ROOT), **dict(t.split("=", 1) for t in os.environ.get("PAIR_TREES", "").split(",") if t)}
for spec in os.environ.get("PAIR_ROUNDS", "one,independent,torchrun,independent,torchrun,one").split(","):
    label, _, var = spec.partition(":"); var = var or "main"
    os.environ["PYTHONPATH"] = TREES[var]
    if label == "one":
        p = subprocess.run(cmd(root / "part0.txt", root / "one.parquet"), capture_output=True, text=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        r = [rate(p.stderr + p.stdout)]
    elif label == "independent":
        ps = [subprocess.Popen(cmd(root / f"part{i}.txt", root / f"ind{i}_{var}.parquet"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)})
              for i in range(G)]
        r = [rate(p.communicate()[0]) for p in ps]
    else:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(G), "-m", "vit_triton",
                            *cmd(root / "all.txt", root / "tr.parquet")[3:]], capture_output=True, text=True)
        whole = rate(p.stderr + p.stdout)
        r = [round(whole / G) if isinstance(whole, int) else whole]
    out.append({"round": spec, "images_per_s_a_gpu": r}); print(json.dumps(out[-1]), flush=True)
    Path(os.environ.get("OUT", "/tmp"), "pair.json").write_text(json.dumps(out, indent=1))
import pyarrow.parquet as pq
base = pq.read_table(root / "ind0_main.parquet")
for var in TREES:
    f = root / f"ind0_{var}.parquet"
    if f.exists():
        print(var, "part 0 output equals main's:", pq.read_table(f).equals(base), flush=True)
