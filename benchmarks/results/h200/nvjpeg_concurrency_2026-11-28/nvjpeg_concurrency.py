"""nvJPEG alone in 1, 2 and 4 processes at once, each on its own GPU, on the same JPEG batches in memory: does a
rank's decoding rate fall when others decode on other GPUs of the host? Prints per-process images/s, and writes
them to $OUT/nvjpeg_conc.json. Process counts from NJ_COUNTS (default 1,4,2,1,4; this run: 1,2,1,2 on two GPUs).

    NJ_COUNTS=1,2,1,2 OUT=. python benchmarks/results/h200/nvjpeg_concurrency_2026-11-28/nvjpeg_concurrency.py main
"""
import json, os, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "scripts")); sys.path.insert(0, str(ROOT))
FOLDER = Path("/tmp/nj")
if sys.argv[1] == "child":
    start_at, seconds = float(sys.argv[2]), float(sys.argv[3])
    from vit_triton.data.decode import nvjpeg_decode, widen_hardware_queues
    widen_hardware_queues()
    import torch
    files = sorted(FOLDER.rglob("*.jpg"))[:2048]
    batches = [[torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files[i:i + 256]]
               for i in range(0, len(files), 256)]
    dev = torch.device("cuda")
    with torch.inference_mode():
        for b in batches[:2]:
            nvjpeg_decode(b, dev)
        torch.cuda.synchronize()
        while time.time() < start_at:
            time.sleep(0.001)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            for b in batches:
                nvjpeg_decode(b, dev); n += len(b)
        torch.cuda.synchronize()
        print(json.dumps({"gpu": os.environ["CUDA_VISIBLE_DEVICES"], "images_per_s": round(n / (time.perf_counter() - t0))}), flush=True)
    sys.exit(0)
from embed_throughput import make_images
make_images(FOLDER, 2048)
out = {}
for n in [int(c) for c in os.environ.get("NJ_COUNTS", "1,4,2,1,4").split(",")]:
    start_at = time.time() + 12
    procs = [subprocess.Popen([sys.executable, __file__, "child", str(start_at), "6"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": str(g)}) for g in range(n)]
    rates = [json.loads(p.communicate()[0].strip().splitlines()[-1])["images_per_s"] for p in procs]
    out.setdefault(str(n), []).append(rates)
    print(n, "processes:", rates, flush=True)
    Path(os.environ.get("OUT", "/tmp"), "nvjpeg_conc.json").write_text(json.dumps(out, indent=1))
