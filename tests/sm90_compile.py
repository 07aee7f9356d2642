"""Compile every kernel for Hopper (sm_90) on a machine without a GPU; run as a script.

The interpreter executes kernels as Python and accepts code that Triton's compiler rejects (a
non-constexpr global, say); this compiles each kernel's first autotune config for every dtype
and epilogue through to a cubin (as launched on Hopper, with programmatic dependent launch), and
prints how many wgmma, TMA (cp.async.bulk.tensor), asynchronous copy (cp.async), griddepcontrol
and L2 prefetch instructions each PTX holds (the prefetches: in all, and before the wait), how many
global loads, stores and copies come before the wait, whether the next kernel is let launch
before the first load after the wait (PDL_EARLY), and the shared memory a program takes.
"""

from __future__ import annotations

import itertools
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from vit_triton.cli import torch_dtype  # noqa: E402
from vit_triton.kernels.attention import (  # noqa: E402
    BACKWARD_CANDIDATES, CANDIDATES, DELTA_BLOCK_M, ONE_PASS, _attention_backward_kernel, _attention_kernel,
    _delta_kernel, key_pieces,
)
from vit_triton.kernels.layer_norm import _layer_norm_backward_kernel, _layer_norm_kernel  # noqa: E402
from vit_triton.kernels.common import PDL_EARLY, PDL_LATE  # noqa: E402
from vit_triton.kernels.tuning import Config  # noqa: E402
from vit_triton.kernels.activation import ACTIVATIONS, gelu_fit_degree  # noqa: E402
from vit_triton.kernels.linear import (  # noqa: E402
    FLOAT32, LARGE_M, TINY_M, WIDE_RESIDUAL, _backward_candidates, _column_sums_kernel, _grad_kernel,
    _linear_backward_plain_kernel, _linear_backward_tma_kernel, _linear_plain_kernel, _linear_tma_kernel, _sum_kernel,
)
from vit_triton.kernels.patch_embed import (  # noqa: E402
    _patch_embed_dpixels_kernel, _patch_embed_dweight_kernel, _patch_embed_kernel,
    _patch_embed_token_sums_kernel,
)
from vit_triton.kernels.resize import (  # noqa: E402
    BLOCK, FILTERS, POSITIONS, SUPPORT, _resize_pass_kernel, _resize_weights_kernel,
)
from vit_triton.kernels.chroma import MIN_IMAGES, TILE, _codes_kernel, _upsample_kernel  # noqa: E402
from vit_triton.kernels.tf32 import _round_to_tf32_kernel  # noqa: E402
from vit_triton.kernels.token_mean import _token_mean_backward_kernel, _token_mean_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ONE_PIECE = dict(SPLIT=False, BLOCK_E=16, ALIGN=16)   # attention's head dim in one piece, strides multiples of 16
FLOAT_ARGS = {"eps", "qk_scale", "scale", "bias_mult"}
# Integers that are multiples of 16 in every ViT launch (widths, row and head strides; the backward
# products' P, Q and R, widths but dW's R, the rows, which no load's contiguous dimension is masked by).
# Triton specializes such arguments at launch; without that its pipeliner cannot prove 16-byte alignment
# and copies nothing ahead, so the PTX here would not be the one the GPU runs.
ALIGNED_INTS = re.compile(r"[NKDPQR]|stride_\w+|s[qkvo]_[bth]")
LINEAR_OUTPUT = "y"   # the TMA linear kernel's output: a descriptor, or a pointer
# The backward's fp32 statistics and partial sums: log-sum-exp and rowsum(dO * O), a norm's mean and 1 / std,
# a norm's and LayerScale's partial gradients; stochastic depth's per-row factors; attention's bias gradient.
FLOAT32_POINTERS = {"lse_ptr", "delta_ptr", "stats_ptr", "dsum_ptr", "dgamma_ptr", "row_scale_ptr", "dbias_ptr"}
INDEX_POINTERS = {"table_ptr": "*i64", "images_ptr": "*i32", "first_ptr": "*i32", "taps_ptr": "*i32",   # resize's
                  "meta_ptr": "*i32", "codes_ptr": "*i32", "counts_ptr": "*i64"}   # and chroma's
# Global loads, stores, copies and atomics in PTX (not the L2 prefetch, an inline asm block of its own).
MEMORY_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:(?:ld|st)\.global|cp\.async|atom\.|red\.)", re.M)


def compile_kernel(kernel, dtype: str, options: dict, constexprs: dict, types: dict | None = None) -> tuple[str, int]:
    """(PTX, bytes of shared memory a program takes) of `kernel` (a JITFunction or an Autotuner, whose first config
    is used) for sm_90.

    Pointer arguments (named *_ptr) get `dtype` ("tf32" means fp32 pointers) but the fp32 partial
    sums of split K and the fp32 statistics, integers i32; `types` maps argument names to TMA descriptor
    block shapes (those arguments' type) or to a type of their own ("*fp32")."""
    if isinstance(kernel, triton.runtime.Autotuner):
        config = kernel.configs[0]
        constexprs = {**constexprs, **config.kwargs}
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **options}
        kernel = kernel.fn
    element = "fp32" if dtype == "tf32" else dtype
    signature = {}
    for p in kernel.params:
        # given a value here: None (an absent argument) or 1 (an integer that Triton specializes at launch)
        if p.is_constexpr or p.name in constexprs:
            signature[p.name] = "constexpr"
        elif types and isinstance(types.get(p.name), str):
            signature[p.name] = types[p.name]
        elif types and p.name in types:
            signature[p.name] = f"tensordesc<{element}{list(types[p.name])}>"
        elif p.name in FLOAT32_POINTERS:
            signature[p.name] = "*fp32"
        elif p.name == "parts_ptr" or (p.name in ("y", "y_ptr") and constexprs.get("SPLIT_K", 1) > 1):
            signature[p.name] = "*fp32"
        elif p.name in ("cos_ptr", "sin_ptr"):   # linear's rotary tables, float32 for every dtype
            signature[p.name] = "*fp32"
        elif p.name in INDEX_POINTERS:
            signature[p.name] = INDEX_POINTERS[p.name]
        elif p.name.endswith("_ptr") or p.name == LINEAR_OUTPUT:
            signature[p.name] = f"*{element}"
        else:
            signature[p.name] = "fp32" if p.name in FLOAT_ARGS else "i32"
    constexprs = {"PDL": PDL_LATE, **constexprs}   # as launched on Hopper
    index = {p.name: (i,) for i, p in enumerate(kernel.params)}
    aligned = {index[name]: [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*") or (kind == "i32" and ALIGNED_INTS.fullmatch(name))}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, attrs=aligned,
                                    constexprs={index[k]: v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=TARGET, options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def linear_case(name: str, dtype: str, config: Config, pdl: int = PDL_LATE, split_k: int = 1, tma: bool = False,
                **flags):
    """linear with this launch config: the plain kernel, or with tma the TMA kernel, prefetching its weights and
    passed x, w, r and y (but a residual product's y and split K's fp32 partial sums) as descriptors of its tiles."""
    bm, bn, bk, warps, stages, _ = config
    defaults = dict(X_TF32=False, W_TF32=False, Y_TF32=False, ROPE=False, ROPE_HALF=False, HEAD_DIM=0,
                    GELU_FIT_DEGREE=gelu_fit_degree(torch_dtype(dtype), flags["ACT"]))
    if not flags.get("ROPE"):
        defaults.update(cos_ptr=None, sin_ptr=None)
    constexprs = dict(defaults | flags, PDL=pdl, SPLIT_K=split_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
    options = {"num_warps": warps, "num_stages": stages}
    if not tma:
        return name, _linear_plain_kernel, dtype, options, constexprs, None
    descriptors = dict(x_desc=(bm, bk), w_desc=(bn, bk))
    out_bn = bn // 2 if flags["ACT"] == "swiglu" else bn   # swiglu's y tile is half the product's
    if flags["HAS_RESIDUAL"]:   # y through pointers
        descriptors["r_desc"] = (bm, out_bn)
    else:
        constexprs["r_desc"] = None
        if split_k == 1:
            descriptors["y"] = (bm, out_bn)
    return name, _linear_tma_kernel, dtype, options, dict(constexprs, PREFETCH=True), descriptors


def cases():
    """(name, kernel, dtype, options, constexprs, descriptors): each dtype once, each epilogue flag
    once in bf16."""
    epilogues = [(True, "none", False)] + [(b, act, not b) for act in ACTIVATIONS[1:] for b in (True, False)][:4]
    # attention's streaming kernel with its first candidate
    streaming = dict(KEYS0=0, KEYS1=0, KEYS2=0, BLOCK_M=CANDIDATES[0].block_m, BLOCK_N=CANDIDATES[0].block_n)
    streaming_options = {"num_warps": CANDIDATES[0].warps, "num_stages": CANDIDATES[0].stages}
    for dtype in ("fp32", "bf16", "fp16"):
        config = FLOAT32[0] if dtype == "fp32" else LARGE_M[0]
        for bias, act, res in epilogues if dtype == "bf16" else [(True, "gelu", True)]:
            for tma in (False, True):
                yield linear_case("linear-tma" if tma else "linear", dtype, config, HAS_BIAS=bias, ACT=act,
                                  HAS_RESIDUAL=res, HAS_SCALE=not bias, INPUT_PRECISION="ieee", tma=tma)
        # A gated MLP's fc1 (swiglu: the tile halved in the epilogue), and with every other epilogue step.
        for tma, rest in itertools.product((False, True), (False, True)):
            yield linear_case(f"linear{'-tma' * tma}-swiglu", dtype, config, HAS_BIAS=True, ACT="swiglu",
                              HAS_RESIDUAL=rest, HAS_SCALE=rest, INPUT_PRECISION="ieee", tma=tma)
        # A QKV projection that rotates q and k (rotary embeddings): pairs side by side, or a half apart.
        for tma, half in itertools.product((False, True), (False, True)) if dtype == "bf16" else ():
            yield linear_case(f"linear{'-tma' * tma}-rope{'-half' * half}", dtype, config, HAS_BIAS=True, ACT="none",
                              HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION="ieee", tma=tma, ROPE=True,
                              ROPE_HALF=half, HEAD_DIM=64)
        # Training's epilogues: fc1 keeps its pre-activation for the derivative; fc2 scales by LayerScale's gamma and
        # each image's stochastic-depth factor (float32) before the residual.
        for tma in (False, True) if dtype == "bf16" else ():
            yield linear_case(f"linear{'-tma' * tma}-train-fc1", dtype, config, HAS_BIAS=True, ACT="gelu",
                              HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION="ieee", tma=tma, PRE_OUT=True,
                              col_scale_ptr=None, row_scale_ptr=None)
            yield linear_case(f"linear{'-tma' * tma}-train-fc2", dtype, config, HAS_BIAS=True, ACT="none",
                              HAS_RESIDUAL=True, HAS_SCALE=False, INPUT_PRECISION="ieee", tma=tma, HAS_COL_SCALE=True,
                              HAS_ROW_SCALE=True, pre_ptr=None)
        if dtype == "bf16":   # the residual GEMMs' wide tile at large batch
            yield linear_case("linear-tma-wide-residual", dtype, WIDE_RESIDUAL, HAS_BIAS=True, ACT="none",
                              HAS_RESIDUAL=True, HAS_SCALE=False, INPUT_PRECISION="ieee", tma=True)
        # Launches whose programs all fit on the SMs: one image's GEMMs, and its GEMMs split along K.
        for tma, split_k in itertools.product((False, True), (1, 2)) if dtype == "bf16" else ():
            yield linear_case(f"linear{'-tma' * tma}{'-split' * (split_k > 1)}-early", dtype, TINY_M[0], PDL_EARLY,
                              split_k, HAS_BIAS=True, ACT="none", HAS_RESIDUAL=False, HAS_SCALE=False,
                              INPUT_PRECISION="ieee", tma=tma)
        # SigLIP SO400M's head dim of 72 in two pieces (64 + 16), its head stride a multiple of 8
        yield ("fused_attention", _attention_kernel, dtype, streaming_options,
               dict(HEAD_DIM=72, BLOCK_D=64, SPLIT=True, BLOCK_E=16, ALIGN=8, INPUT_PRECISION="ieee", QKV_TF32=False,
                    O_TF32=False, bias_ptr=None, HAS_BIAS=False, **streaming), None)
        # One pass over 197 keys, as fused_attention launches it at one ViT-B image; with BEiT's bias in bf16.
        for bias in (False, True) if dtype == "bf16" else (False,):
            yield (f"fused_attention{'-bias' * bias}-one-pass-early", _attention_kernel, dtype,
                   {"num_warps": ONE_PASS.warps, "num_stages": ONE_PASS.stages},
                   dict(HEAD_DIM=64, BLOCK_D=64, **ONE_PIECE, INPUT_PRECISION="ieee", QKV_TF32=False, O_TF32=False,
                        PDL=PDL_EARLY,
                        **dict(zip(("KEYS0", "KEYS1", "KEYS2"), key_pieces(197))), BLOCK_M=ONE_PASS.block_m,
                        BLOCK_N=ONE_PASS.block_n, HAS_BIAS=bias, **({} if bias else {"bias_ptr": None})), None)
        if dtype == "bf16":
            yield ("fused_attention-bias", _attention_kernel, dtype, streaming_options,
                   dict(HEAD_DIM=64, BLOCK_D=64, **ONE_PIECE, INPUT_PRECISION="ieee", QKV_TF32=False, O_TF32=False,
                        HAS_BIAS=True, **streaming), None)
        yield ("patch_embed", _patch_embed_kernel, dtype, {}, dict(
            PATCH=16, HAS_BIAS=True, HAS_PREFIX=True, HAS_POS=True, POS_HAS_PREFIX=dtype != "fp16",
            INPUT_PRECISION="ieee", W_TF32=False), None)
        for parts in (0, 2) if dtype == "bf16" else (0,):   # 2: add_layer_norm after a GEMM split in two
            yield (f"layer_norm{'-add' * (parts > 0)}", _layer_norm_kernel, dtype, {"num_warps": 4},
                   dict(HAS_BIAS=True, RMS=False, HAS_ADD=False, NUM_PARTS=parts, BLOCK_M=2, BLOCK_D=1024), None)
        if dtype == "bf16":   # RMSNorm without bias, and with a table added after it (AIMv2's patch embeddings)
            for post_add in (False, True):
                yield (f"layer_norm-rms{'-post-add' * post_add}", _layer_norm_kernel, dtype, {"num_warps": 4},
                       dict(b_ptr=None, HAS_BIAS=False, RMS=True, HAS_ADD=post_add, NUM_PARTS=0, BLOCK_M=2,
                            BLOCK_D=1024), None)
        yield ("token_mean", _token_mean_kernel, dtype, {"num_warps": 4}, dict(BLOCK_T=16, BLOCK_D=256), None)
    # tf32: operands rounded in the kernel, or beforehand (the weight by round_to_tf32, x by the kernel
    # that wrote it, the output for the kernel that reads it).
    for tma, pre in itertools.product((False, True), (False, True)):
        yield linear_case("linear-tma" if tma else "linear", "tf32", FLOAT32[0], HAS_BIAS=True, ACT="gelu",
                          HAS_RESIDUAL=True, HAS_SCALE=False, INPUT_PRECISION="tf32", X_TF32=pre, W_TF32=pre,
                          Y_TF32=pre, tma=tma)
    for tma in (False, True):   # a gated fc1 whose output the next GEMM reads
        yield linear_case(f"linear{'-tma' * tma}-swiglu", "tf32", FLOAT32[0], HAS_BIAS=True, ACT="swiglu",
                          HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION="tf32", X_TF32=True, W_TF32=True,
                          Y_TF32=True, tma=tma)
    yield ("patch_embed", _patch_embed_kernel, "tf32", {}, dict(
        PATCH=16, HAS_BIAS=True, HAS_PREFIX=True, HAS_POS=True, POS_HAS_PREFIX=True, INPUT_PRECISION="tf32",
        W_TF32=True), None)
    yield ("round_to_tf32", _round_to_tf32_kernel, "tf32", {"num_warps": 8}, dict(BLOCK=4096), None)
    for pre in (False, True):
        yield ("fused_attention", _attention_kernel, "tf32", streaming_options,
               dict(HEAD_DIM=64, BLOCK_D=64, **ONE_PIECE, INPUT_PRECISION="tf32", QKV_TF32=pre, O_TF32=pre,
                    bias_ptr=None, HAS_BIAS=False, **streaming), None)
    yield ("layer_norm", _layer_norm_kernel, "tf32", {"num_warps": 4}, dict(HAS_BIAS=True, RMS=False, HAS_ADD=False,
                                                                            NUM_PARTS=2, BLOCK_M=2, BLOCK_D=1024), None)
    # resize (uint8): the weights, torch's bicubic and Pillow's lanczos (float64 sine and cosine), and the passes:
    # rows then columns, columns then rows.
    for filter, torch_bits in (("bicubic", True), ("lanczos", False)):
        yield (f"resize_weights-{filter}", _resize_weights_kernel, "u8", {"num_warps": 4, "enable_fp_fusion": False},
               dict(FILTER=FILTERS.index(filter), SUPPORT=SUPPORT[filter], TORCH=torch_bits, POSITIONS=POSITIONS), None)
    for axis, first in itertools.product((1, 0), (True, False)):
        yield (f"resize_pass-{'rows' if axis else 'columns'}-{'first' if first else 'second'}", _resize_pass_kernel,
               "u8", {"num_warps": 4}, dict(AXIS=axis, FIRST=first, BLOCK_R=BLOCK, BLOCK_C=BLOCK), None)
    # chroma (uint8): each block's chroma read back, then the pixels upsampled.
    for name, kernel in (("chroma_codes", _codes_kernel), ("chroma_upsample", _upsample_kernel)):
        yield name, kernel, "u8", {"num_warps": 4}, dict(IMAGES=MIN_IMAGES, TILE_R=TILE[0], TILE_C=TILE[1]), None

def linear_backward_case(name: str, dtype: str, dw: bool, split: int = 1, tma: bool = False, **flags):
    """One of linear_backward's products with the first config of its path and dtype (_backward_candidates'): dX = dz
    W (with fc1's activation's derivative and its recomputed output where flags say), or dW = dz^T x cut into `split`
    slices of rows (fp32 partial sums) with LayerScale's d gamma; through pointers, or with tma the TMA kernel's
    descriptors."""
    bm, bn, bk, warps, stages, _ = _backward_candidates(tma, torch_dtype(dtype))[0]
    act = flags.get("X_ACT", "none")
    if act == "swiglu":   # d x_pre's tile twice the product's width, as linear_backward halves it
        bn //= 2
    constexprs = dict(DW=dw, STORE_OUT=True, X_ACT=act, GELU_FIT_DEGREE=gelu_fit_degree(torch_dtype(dtype), act),
                      STORE_X=False, HAS_GAMMA=False, DGAMMA=False, INPUT_PRECISION="ieee", A_TF32=False,
                      B_TF32=False, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
    constexprs.update(flags)
    unused = {"x_pre_ptr": act == "none", "x_ptr": not constexprs["STORE_X"],
              "gamma_ptr": not constexprs["HAS_GAMMA"], "w_ptr": not constexprs["DGAMMA"],
              "dgamma_ptr": not constexprs["DGAMMA"]}
    constexprs.update({arg: None for arg, absent in unused.items() if absent})
    options = {"num_warps": warps, "num_stages": stages}
    out = "out" if tma else "out_ptr"
    types = {out: "*fp32"} if split > 1 else {}
    if not tma:   # A's unit stride, specialized at launch: along R for dz (dX), along P for dz^T (dW)
        constexprs["stride_ap" if dw else "stride_ar"] = 1
        return name, _linear_backward_plain_kernel, dtype, options, constexprs, types
    types.update(a_desc=(bk, bm) if dw else (bm, bk), b_desc=(bk, bn))
    if split == 1:
        types[out] = (bm, 2 * bn if act == "swiglu" else bn)
    return name, _linear_backward_tma_kernel, dtype, options, dict(constexprs, OUT_TMA=split == 1), types


def backward_cases():
    """(name, kernel, dtype, options, constexprs, types) of the training kernels, in bf16: each product and
    epilogue of linear_backward through both paths, attention's backward at a head dim of 64 and of 72, the
    norms', the pooling's and the patch embedding's; and linear's in tf32."""
    for tma in (False, True):
        path = "-tma" * tma
        # fc2's dX: GELU's derivative at fc1's pre-activation, and fc1's output recomputed for fc2's dW
        yield linear_backward_case(f"linear{path}-backward-dx", "bf16", False, tma=tma, X_ACT="gelu", STORE_X=True)
        yield linear_backward_case(f"linear{path}-backward-dx-swiglu", "bf16", False, tma=tma, X_ACT="swiglu")
        yield linear_backward_case(f"linear{path}-backward-dw", "bf16", True, tma=tma)
        # LayerScale's d gamma from the dW tiles, the rows cut into two slices
        yield linear_backward_case(f"linear{path}-backward-dw-split", "bf16", True, 2, tma=tma, HAS_GAMMA=True,
                                   DGAMMA=True)
        yield linear_backward_case(f"linear{path}-backward-dw", "tf32", True, tma=tma, INPUT_PRECISION="tf32")
    row_kernel = {"num_warps": 4}
    yield ("grad", _grad_kernel, "bf16", row_kernel, dict(
        row_scale_ptr=None, cos_ptr=None, sin_ptr=None, ACT="gelu", HAS_ROW_SCALE=False, HAS_SCALE=False,
        ROPE=False, ROPE_HALF=False, HEAD_DIM=0, BLOCK_M=32, BLOCK_N=128), None)
    yield ("sum_slices", _sum_kernel, "bf16", row_kernel, dict(BLOCK=1024), {"parts_ptr": "*fp32"})
    yield ("column_sums", _column_sums_kernel, "bf16", row_kernel, dict(ROWS=256, BLOCK_M=32, BLOCK_N=128), None)
    yield ("attention_delta", _delta_kernel, "bf16", row_kernel,
           dict(HEAD_DIM=64, BLOCK_D=64, ALIGN=16, BLOCK_M=DELTA_BLOCK_M), None)
    first = BACKWARD_CANDIDATES[0]
    for head_dim, width, bias in ((64, 64, False), (72, 128, False), (64, 64, True)):   # BEiT's bias and its dS
        absent = {} if bias else {"bias_ptr": None, "dbias_ptr": None}
        yield (f"fused_attention-backward-{head_dim}{'-bias' * bias}", _attention_backward_kernel, "bf16",
               {"num_warps": first.warps, "num_stages": first.stages},
               dict(HEAD_DIM=head_dim, BLOCK_D=width, ALIGN=min(16, head_dim & -head_dim), INPUT_PRECISION="ieee",
                    HAS_BIAS=bias, STORE_DBIAS=bias,
                    BLOCK_M=first.block_m, BLOCK_N=first.block_n, **absent), None)
    for rms in (False, True):   # LayerNorm's dx, d gamma and d beta; RMSNorm's with a post-added table's gradient
        yield (f"layer_norm{'-rms' * rms}-backward", _layer_norm_backward_kernel, "bf16", row_kernel,
               dict(RMS=rms, NEED_DX=True, NEED_DW=True, SUM_DY=True, PER_ROW=rms, BLOCK_M=4, BLOCK_D=1024),
               {"dw_ptr": "*fp32"})
    yield ("token_mean-backward", _token_mean_backward_kernel, "bf16", row_kernel, dict(BLOCK_T=16, BLOCK_D=256),
           None)
    # contiguous pixels: a unit stride along the image's rows, specialized at launch
    yield ("patch_embed-backward-dpixels", _patch_embed_dpixels_kernel, "bf16", {},
           dict(s_xw=1, PATCH=16, INPUT_PRECISION="ieee", W_TF32=False), None)
    yield ("patch_embed-backward-dweight", _patch_embed_dweight_kernel, "bf16", {},
           dict(s_pw=1, PATCH=16, INPUT_PRECISION="ieee"), {"dw_ptr": "*fp32"})
    yield ("patch_token_sums", _patch_embed_token_sums_kernel, "bf16", row_kernel,
           dict(HAS_POS=True, HAS_PREFIX=True, HAS_BIAS=True, BLOCK_T=16, BLOCK_D=128), {"bias_ptr": "*fp32"})


def main() -> None:
    for name, kernel, dtype, options, constexprs, types in itertools.chain(cases(), backward_cases()):
        ptx, shared = compile_kernel(kernel, dtype, options, constexprs, types)
        prologue, *_, after_wait = ptx.split("griddepcontrol.wait")
        first_trigger = after_wait.find("griddepcontrol.launch_dependents")
        first_load = min((i for i in (after_wait.find(op) for op in ("ld.global", "cp.async")) if i >= 0), default=-1)
        print(f"{name} {dtype} wgmma={ptx.count('wgmma.mma_async')} tma={ptx.count('cp.async.bulk.tensor')} "
              f"cpasync={ptx.count('cp.async.cg') + ptx.count('cp.async.ca')} "
              f"gdc={ptx.count('griddepcontrol.wait')},{ptx.count('griddepcontrol.launch_dependents')} "
              f"memory_before_wait={len(MEMORY_OP.findall(prologue))} "
              f"prefetch={ptx.count('prefetch.global.L2')},{prologue.count('prefetch.global.L2')} "
              f"trigger_before_loads={int(0 <= first_trigger < first_load)} "
              f"sfu={ptx.count('ex2.approx')},{ptx.count('rcp.approx')},{ptx.count('tanh.approx')} "
              f"shared={shared}", flush=True)


if __name__ == "__main__":
    main()
