"""Time candidate tile configs of the linear and attention kernels at ViT shapes (CUDA only).

How the candidate lists in vit_triton/kernels were chosen: each candidate is launched directly
(no tuner), timed from CUDA graph replays (do_bench_cudagraph), and compared with PyTorch at the
same shape (cuBLAS plus the same epilogue in PyTorch ops; SDPA for attention). For linear, each
compiled config is timed in the TMA kernel launched persistently (one and, from a few thousand rows,
two programs per SM) and with one program per tile, and the best six again in the plain kernel
(pointer loads, one program per tile).

    python scripts/sweep_kernels.py [--json sweep.json] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from vit_triton.kernels.activation import gelu_fit_degree
from vit_triton.kernels.common import input_precision, pdl, tma_ready
from vit_triton.kernels.tuning import Config

# The package re-exports the launchers under the modules' names, so the modules come by path.
linear_mod = importlib.import_module("vit_triton.kernels.linear")
attention_mod = importlib.import_module("vit_triton.kernels.attention")

# (name, M, N, K, activation, residual): ViT-B/16 at batches 1, 32 and 256, ViT-L/14 @ 336 at 64.
LINEAR_SHAPES = [
    (f"{model} b{batch} {layer}", batch * tokens, n, k, act, res)
    for model, tokens, dim, act_name, batches in (("B/16", 197, 768, "gelu", (256, 32, 8, 1)),
                                                  ("L/14@336", 577, 1024, "quick_gelu", (64,)))
    for batch in batches
    for layer, n, k, act, res in (("qkv", 3 * dim, dim, "none", False), ("proj", dim, dim, "none", True),
                                  ("fc1", 4 * dim, dim, act_name, False), ("fc2", dim, 4 * dim, "none", True))
] + [("B/16 b256 head", 256, 1000, 768, "none", False), ("B/16 b1 head", 1, 1000, 768, "none", False),
      ("B/16 b256 fc1 no-act", 256 * 197, 3072, 768, "none", False)]  # what the GELU epilogue costs

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
LINEAR_CANDIDATES = [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 5), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4),
    (64, 256, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 64, 64, 4, 4),
    (64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 256, 4, 3), (128, 128, 32, 8, 4),
    (128, 128, 64, 4, 2), (128, 128, 32, 4, 4), (128, 128, 64, 8, 2), (128, 128, 32, 8, 3),
]
# Up to SMALL_M_ROWS rows: smaller tiles that give every SM work (one or two images), or 128-row tiles
# for about one wave (a few thousand rows).
TINY_M_CANDIDATES = [(32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (32, 64, 256, 4, 3), (64, 64, 128, 4, 4),
                     (64, 128, 64, 4, 4), (16, 64, 256, 4, 3), (64, 64, 64, 4, 4), (64, 128, 128, 4, 3),
                     (64, 128, 64, 4, 7), (64, 64, 128, 4, 6), (64, 32, 128, 4, 8), (64, 128, 128, 4, 4)]
SMALL_M_CANDIDATES = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 256, 64, 4, 4),
                      (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]
TF32_CANDIDATES = [(128, 128, 32, 8, 3), (128, 256, 32, 8, 3), (128, 128, 64, 8, 3), (128, 64, 32, 4, 4),
                   (64, 128, 32, 4, 4), (128, 128, 32, 4, 4)]
TF32_SHAPES = [("B/16 b64 fc1 tf32", 64 * 197, 3072, 768, "gelu", False),
               ("B/16 b64 fc2 tf32", 64 * 197, 768, 3072, "none", True)]

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
ATTENTION_CANDIDATES = [
    (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2), (128, 64, 4, 3),
    (64, 256, 4, 1), (128, 256, 8, 1), (64, 64, 4, 2), (128, 128, 8, 3), (64, 128, 8, 2), (128, 64, 8, 2),
    (128, 32, 4, 4), (128, 32, 8, 3), (64, 32, 4, 3), (128, 16, 4, 3), (64, 32, 4, 4),
]
ATTENTION_SHAPES = [("B/16 b256", 256, 197, 12, 64), ("B/16 b32", 32, 197, 12, 64), ("B/16 b1", 1, 197, 12, 64),
                    ("L/14@336 b64", 64, 577, 16, 64)]

ACT = {"none": lambda y: y, "gelu": F.gelu, "quick_gelu": lambda y: y * torch.sigmoid(1.702 * y)}


def bench(fn) -> float:
    """fn's time replayed from a CUDA graph (after one eager call that compiles), as the model runs
    at small batch: GPU time, not Python's launch overhead, which dominates below a few thousand rows."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=40)


def launch_linear(cfg, x, w, b, r, y, act, persistent: int, tma: bool):
    """One launch through the package's launch function, of the TMA kernel or (tma False) the plain one; cfg:
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    flags = dict(HAS_BIAS=True, ACT=act, GELU_FIT_DEGREE=gelu_fit_degree(x.dtype, act),
                 HAS_RESIDUAL=r is not None, HAS_SCALE=False,
                 INPUT_PRECISION=input_precision(x.dtype, True), X_TF32=False, W_TF32=False, Y_TF32=False,
                 ROPE=False, ROPE_HALF=False, HEAD_DIM=0, SPLIT_K=1)
    linear_mod.launch_linear(Config(*cfg, persistent), x, w, b, r, y, 1.0, flags, tma)


def sweep_linear(shapes, candidates, dtype, quick: bool) -> list[dict]:
    rows = []
    for name, M, N, K, act, res in shapes:
        x = torch.randn(M, K, device="cuda").to(dtype)
        w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(dtype)
        b = torch.randn(N, device="cuda").to(dtype)
        r = torch.randn(M, N, device="cuda").to(dtype) if res else None
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        tma = tma_ready(x, w, r, y)   # as the launcher decides
        ref = ACT[act](F.linear(x.float(), w.float(), b.float())) + (r.float() if res else 0)
        torch_fn = (lambda: ACT[act](F.linear(x, w, b)) + r) if res else (lambda: ACT[act](F.linear(x, w, b)))
        t_torch = bench(torch_fn)
        t_cublas = bench(lambda: F.linear(x, w, b))
        timings = []
        small = M <= linear_mod.SMALL_M_ROWS and dtype != torch.float32
        for cfg in (TINY_M_CANDIDATES if M <= 512 else SMALL_M_CANDIDATES) if small else candidates:
            try:
                t0 = time.time()
                launch_linear(cfg, x, w, b, r, y, act, 1, tma)
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                for persistent in (1, 0) if small else (1, 2, 0):
                    t = bench(lambda: launch_linear(cfg, x, w, b, r, y, act, persistent, tma))
                    timings.append({"config": cfg, "persistent": persistent, "tma": tma, "ms": t, "max_rel_err": err,
                                    "first_call_s": compile_s})
            except Exception as e:  # out of shared memory, say
                timings.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        ok = sorted((t for t in timings if "ms" in t), key=lambda t: t["ms"])
        if tma and not quick:
            for best in ok[:6]:
                t = bench(lambda: launch_linear(best["config"], x, w, b, r, y, act, best["persistent"], False))
                timings.append({**best, "tma": False, "ms": t})
        ok = sorted((t for t in timings if "ms" in t), key=lambda t: t["ms"])
        flops = 2 * M * N * K
        row = {"shape": name, "M": M, "N": N, "K": K, "act": act, "residual": res, "dtype": str(dtype),
               "torch_ms": t_torch, "cublas_ms": t_cublas, "best": ok[0] if ok else None, "timings": timings}
        rows.append(row)
        if ok:
            print(f"{name:24s} {dtype} torch {t_torch:.4f} ms (cuBLAS alone {t_cublas:.4f})  best {ok[0]['ms']:.4f} ms "
                  f"{flops / ok[0]['ms'] / 1e9:.0f} TFLOP/s {ok[0]['config']} persistent={ok[0]['persistent']} "
                  f"tma={ok[0]['tma']}  vs torch {t_torch / ok[0]['ms']:.2f}x", flush=True)
            for t in ok[1:6]:
                print(f"{'':24s}   {t['ms']:.4f} ms {t['config']} persistent={t['persistent']} tma={t['tma']}")
    return rows


def sweep_attention(dtype, shapes) -> list[dict]:
    rows = []
    for name, B, T, H, Dh in shapes:
        qkv = torch.randn(B, T, 3, H, Dh, device="cuda").to(dtype)
        q, k, v = qkv.unbind(2)
        o = torch.empty(B, T, H, Dh, device="cuda", dtype=dtype)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt))
        ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float()).transpose(1, 2)
        timings = []
        for bm, bn, warps, stages in ATTENTION_CANDIDATES:
            def run():
                attention_mod._attention_kernel[(B * H * triton.cdiv(T, bm),)](
                    q, k, v, o, T, H, T, Dh ** -0.5 * math.log2(math.e),
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                    HEAD_DIM=Dh, BLOCK_D=Dh, INPUT_PRECISION="ieee", QKV_TF32=False, O_TF32=False,
                    KEYS0=0, KEYS1=0, KEYS2=0, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=warps, num_stages=stages, **pdl(q.device, B * H * triton.cdiv(T, bm)))
            try:
                run()
                err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
                timings.append({"config": (bm, bn, warps, stages), "ms": bench(run), "max_rel_err": err})
            except Exception as e:
                timings.append({"config": (bm, bn, warps, stages), "error": f"{type(e).__name__}: {str(e)[:200]}"})
        ok = sorted((t for t in timings if "ms" in t), key=lambda t: t["ms"])
        rows.append({"shape": name, "B": B, "T": T, "H": H, "Dh": Dh, "sdpa_ms": t_sdpa, "timings": timings})
        print(f"attention {name:14s} sdpa {t_sdpa:.4f} ms  best {ok[0]['ms']:.4f} ms {ok[0]['config']}  "
              f"vs sdpa {t_sdpa / ok[0]['ms']:.2f}x", flush=True)
        for t in ok[1:5]:
            print(f"{'':24s}   {t['ms']:.4f} ms {t['config']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument("--quick", action="store_true", help="skip the TMA-off re-timing")
    parser.add_argument("--only", choices=("linear", "tf32", "attention"), action="append")
    parser.add_argument("--shapes", default="", help="only shapes whose name contains one of these (comma-separated)")
    args = parser.parse_args()
    only = set(args.only or ("linear", "tf32", "attention"))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    start = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    def chosen(shapes):
        return [s for s in shapes if any(part in s[0] for part in args.shapes.split(","))]

    if "attention" in only:
        result["attention"] = sweep_attention(torch.bfloat16, chosen(ATTENTION_SHAPES))
    if "linear" in only:
        result["linear"] = sweep_linear(chosen(LINEAR_SHAPES), LINEAR_CANDIDATES, torch.bfloat16, args.quick)
    if "tf32" in only:
        torch.backends.cuda.matmul.allow_tf32 = True
        result["tf32"] = sweep_linear(chosen(TF32_SHAPES), TF32_CANDIDATES, torch.float32, args.quick)
    print(f"done in {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
