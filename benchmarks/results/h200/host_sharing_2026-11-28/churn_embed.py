"""Does embed on one GPU (15 workers, as a rank at 4 GPUs) slow down when other processes fault in fresh memory
(as three more ranks would), and not when they copy as much through memory used again? Rounds (CE_ROUNDS): alone,
with CE_N fresh-memory churners, with CE_N reuse churners, alone. Prints images/s of each embed (CE_COUNT paths,
20,000 generated JPEGs and links to them) and the churners' GB/s. Run from the checkout with PYTHONPATH set to it."""
import json, mmap, os, re, signal, subprocess, sys, time
from pathlib import Path
import numpy as np
ROOT = Path(__file__).resolve().parents[4]   # the checkout
SIZE = 48 << 20
if len(sys.argv) > 1 and sys.argv[1] == "churn":
    mode, src, n, t0 = sys.argv[2], np.ones(SIZE, np.uint8), 0, time.perf_counter()
    dst = np.zeros(SIZE, np.uint8)
    def report(*_):
        print(round(n * SIZE / (time.perf_counter() - t0) / 1e9, 2), flush=True); sys.exit(0)
    signal.signal(signal.SIGTERM, report)
    while True:
        if mode == "fresh":
            m = mmap.mmap(-1, SIZE); np.frombuffer(m, np.uint8)[:] = src; m.close()
        else:
            dst[:] = src
        n += 1
sys.path.insert(0, str(ROOT / "scripts")); sys.path.insert(0, str(ROOT))
from embed_throughput import make_images, make_checkpoint, read_all
root = Path("/tmp/ce"); count = int(os.environ.get("CE_COUNT", "100000")); churners = int(os.environ.get("CE_N", "10"))
paths = make_images(root / "images", count, distinct=20000)
read_all(paths[:20000])
ck = make_checkpoint(root / "vitb")
(root / "list.txt").write_text("\n".join(paths) + "\n")
(root / "warm.txt").write_text("\n".join(paths[:1024]) + "\n")
env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
subprocess.run([sys.executable, "-m", "vit_triton", "embed", str(root / "warm.txt"), "--model", str(ck), "--output",
                str(root / "warm.parquet"), "--overwrite", "--no-progress"], check=True, capture_output=True, env=env)
DONE = re.compile(r"this run: (\d+) images in ([\d.]+) s")
def vm():
    return {l.split()[0]: int(l.split()[1]) for l in open("/proc/vmstat") if l.split()[0] in ("pgfault", "pgalloc_normal")}
out = []
for label in os.environ.get("CE_ROUNDS", "alone,fresh,reuse,alone,fresh").split(","):
    ch = [] if label == "alone" else [subprocess.Popen([sys.executable, __file__, "churn", label], stdout=subprocess.PIPE,
                                                       text=True) for _ in range(churners)]
    time.sleep(1)
    v0, t0 = vm(), time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "vit_triton", "embed", str(root / "list.txt"), "--model", str(ck), "--output",
                        str(root / "out.parquet"), "--overwrite", "--no-progress", "--num-workers", "15"],
                       capture_output=True, text=True, env=env)
    secs, v1 = time.perf_counter() - t0, vm()
    for c in ch:
        c.send_signal(signal.SIGTERM)
    rates = [float(c.communicate()[0].strip() or 0) for c in ch]
    m = DONE.search(p.stderr + p.stdout)
    r = {"round": label, "churners": len(ch), "churn_gb_per_s": round(sum(rates), 1),
         "images_per_s": round(int(m.group(1)) / float(m.group(2))) if m else (p.stderr + p.stdout)[-400:],
         "faults_per_s": round((v1["pgfault"] - v0["pgfault"]) / secs), "wall_s": round(secs, 1)}
    out.append(r); print(json.dumps(r), flush=True)
    Path(os.environ.get("OUT", "/tmp"), "churn_embed.json").write_text(json.dumps(out, indent=1))
