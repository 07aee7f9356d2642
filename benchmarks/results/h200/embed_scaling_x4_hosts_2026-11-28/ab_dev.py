"""torchrun embed over all GPUs with two trees of vit_triton in turn (AB_TREES: name=path; "main" is this
checkout; "dev" was it with the decoding threads made to take their rank's GPU as current, now on main): each run's
whole and steady rates, the most memory nvidia-smi saw on each GPU during it, and whether its output equals the
first's (AB_ONE: the one-GPU run first, embed's default workers). python ab_dev.py NUM_PATHS"""
import json, os, subprocess, sys, threading, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]   # the checkout
sys.path.insert(0, str(ROOT / "scripts")); sys.path.insert(0, str(ROOT))
import torch
import embed_scaling as es
from embed_throughput import make_images, make_checkpoint, read_all
import pyarrow.parquet as pq
N = int(sys.argv[1]); G = torch.cuda.device_count()
root = Path("/tmp/es"); t0 = time.perf_counter()
paths = make_images(root / "images", N, distinct=20000); read_all(paths[:20000])
print("images", time.perf_counter() - t0, flush=True)
ck = es.make_checkpoint(root / "vit_base_patch16_224", "vit_base_patch16_224")
inputs = root / "ab.txt"; inputs.write_text("\n".join(paths[:N]) + "\n")
warm = root / "ab-warm.txt"; warm.write_text("\n".join(paths[:3 * 256]) + "\n")
TREES = {"main": ROOT, **{k: Path(v) for k, v in (t.split("=", 1) for t in os.environ.get("AB_TREES", "").split(",") if t)}}
def peak(stop, out):
    while not stop.is_set():
        q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout.split()
        out[:] = [max(a, int(b)) for a, b in zip(out or [0] * len(q), q)]
        time.sleep(0.3)
es.run(1, ck, warm, root / "ab-warm1.parquet", "gpu")
for tree in TREES.values():
    es.REPO = tree; es.run(G, ck, warm, root / "ab-warm.parquet", "gpu")
res = []; ref = None
if os.environ.get("AB_ONE"):   # the one-GPU baseline on this machine, embed's default workers
    es.REPO = TREES["main"]
    r = es.run(1, ck, inputs, root / "ab-one.parquet", "gpu"); r["tree"] = "one"; res.append(r)
    ref = pq.read_table(root / "ab-one.parquet")
    print(json.dumps({k: r[k] for k in ("seconds", "images_per_s", "steady_images_per_s_per_gpu", "first_chunk_end_s",
                                        "after_last_chunk_s")}), flush=True)
for var in os.environ.get("AB_ROUNDS", "main,dev,main,dev,main,dev").split(","):
    es.REPO = TREES[var]
    stop, mem = threading.Event(), []
    th = threading.Thread(target=peak, args=(stop, mem)); th.start()
    r = es.run(G, ck, inputs, root / f"ab-{var}.parquet", "gpu")
    stop.set(); th.join()
    t = pq.read_table(root / f"ab-{var}.parquet")
    ref = t if ref is None else ref
    r.update(tree=var, peak_memory_mb=mem, output_equals_first=t.equals(ref))
    res.append(r)
    print(json.dumps({k: r[k] for k in ("tree", "seconds", "wall_seconds", "images_per_s_per_gpu",
          "steady_images_per_s_per_gpu", "steady_images_per_s_by_rank", "first_chunk_end_s", "after_last_chunk_s",
          "peak_memory_mb", "output_equals_first")}), flush=True)
    Path(os.environ.get("OUT", "/tmp"), "ab_dev.json").write_text(json.dumps(res, indent=1))
