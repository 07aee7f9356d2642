"""Parity on a CUDA device at real model shapes, with random weights.

google/vit-base-patch16-224 (HF ViTForImageClassification), vit_large_patch14_clip_336 (timm), and the
families at their real shapes through transformers: DINOv2 ViT-L/14 with registers (518 px, run at 224: the
position embedding resampled), CLIP ViT-L/14 @ 336 with its projection, SigLIP SO400M/14 @ 384 (head dim 72,
attention pool); float32 (tf32 off) / tf32 (float32 with every matmul, ours and the reference's, on tf32) / bfloat16 /
float16, batch 1 and 64. Features and outputs of vit-triton and of the reference model in each
precision are compared with the reference model in float64; the tolerance rule of docs/design.md applies (fp32 <= 1e-5,
16-bit and tf32 <= 1.5x the reference's own error). Each row also
times both forwards (median, CUDA events; ours replayed as a CUDA graph, after checking that the
replay equals the eager forward bit for bit) as a first look; `vit-triton bench` is the benchmark.

    python scripts/gpu_check.py [--json results.json] [--models vit-base,clip-large,dinov2-large,...]
        [--precisions float32,tf32,bfloat16,float16] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

import vit_triton
from vit_triton.bench.numerics import randomize_, rel_err, tolerance

PRECISIONS = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BATCHES = (1, 64)


def _random(module: torch.nn.Module) -> torch.nn.Module:
    return randomize_(module).eval()


def hf_vit_base() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import ViTConfig, ViTForImageClassification

    ref = _random(ViTForImageClassification(ViTConfig(num_labels=1000)))  # google/vit-base-patch16-224's config
    return ("google/vit-base-patch16-224", ref, vit_triton.from_hf,
            lambda m, px: (m.vit(px).last_hidden_state, m(px).logits), 224)


def timm_clip_large() -> tuple[str, torch.nn.Module, callable, callable, int]:
    import timm

    ref = _random(timm.create_model("vit_large_patch14_clip_336", pretrained=False))
    return ("vit_large_patch14_clip_336", ref, vit_triton.from_timm,
            lambda m, px: (f := m.forward_features(px), m.forward_head(f)), 336)


def _hf_family(name: str, model: torch.nn.Module, size: int) -> tuple[str, torch.nn.Module, callable, callable, int]:
    """A transformers vision encoder: last_hidden_state and the image embedding (pooler_output, projected
    where the model has a projection), at `size` (position embedding resampled when it is not the model's)."""
    kw = {} if type(model).__name__.startswith(("Dinov2", "DINOv3", "Aimv2")) else {"interpolate_pos_encoding": True}

    def run(m, px):
        out = (m.vision_model if hasattr(m, "visual_projection") else m)(px, **kw)
        pooled = out.pooler_output
        return out.last_hidden_state, m.visual_projection(pooled) if hasattr(m, "visual_projection") else pooled
    return name, _random(model), vit_triton.from_hf, run, size


def hf_dinov2_large() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    config = Dinov2WithRegistersConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, patch_size=14,
                                       image_size=518, num_register_tokens=4)
    return _hf_family("facebook/dinov2-with-registers-large @ 224", Dinov2WithRegistersModel(config), 224)


def hf_clip_large() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              patch_size=14, image_size=336, projection_dim=768)
    return _hf_family("openai/clip-vit-large-patch14-336", CLIPVisionModelWithProjection(config), 336)


def hf_siglip_so400m() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                                patch_size=14, image_size=384)
    return _hf_family("google/siglip-so400m-patch14-384", SiglipVisionModel(config), 384)


def timm_eva02_base() -> tuple[str, torch.nn.Module, callable, callable, int]:
    import timm

    ref = _random(timm.create_model("eva02_base_patch14_448", pretrained=False))
    return ("eva02_base_patch14_448", ref, vit_triton.from_timm,
            lambda m, px: (f := m.forward_features(px), m.forward_head(f)), 448)


def hf_dinov3_large() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    config = DINOv3ViTConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                             patch_size=16, image_size=224, num_register_tokens=4)
    return _hf_family("facebook/dinov3-vitl16-pretrain-lvd1689m", DINOv3ViTModel(config), 224)


def hf_aimv2_large() -> tuple[str, torch.nn.Module, callable, callable, int]:
    from transformers import Aimv2VisionConfig, Aimv2VisionModel

    # The defaults are apple/aimv2-large-patch14-224's: RMSNorm, SwiGLU, no biases, head dim 128, the pooling head.
    return _hf_family("apple/aimv2-large-patch14-224", Aimv2VisionModel(Aimv2VisionConfig()), 224)


def set_tf32(on: bool) -> None:
    """Every float32 matmul and convolution, ours and PyTorch's, on tf32 (on) or exact (off)."""
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on


def check_model(name, ref32, convert, run_ref, size, rows, precisions, batches, save) -> None:
    device = torch.device("cuda")
    ref32 = ref32.to(device)
    ref64 = copy.deepcopy(ref32).double()
    for batch in batches:
        px = torch.randn(batch, 3, size, size, device=device)
        with torch.inference_mode():
            want = run_ref(ref64, px.double())
        for precision in precisions:
            dtype = PRECISIONS[precision]
            set_tf32(precision == "tf32")
            ref = copy.deepcopy(ref32).to(dtype)
            ours = convert(ref)
            x = px.to(dtype)
            graphed = vit_triton.compile(ours, batch_sizes=[batch])
            with torch.inference_mode():
                got = (ours.forward_features(x), ours(x))
                if not torch.equal(graphed(x), got[1]):
                    raise AssertionError(f"{name} b={batch} {dtype}: CUDA-graph replay differs from the eager forward")
                theirs = run_ref(ref, x)
                ms_ours = triton.testing.do_bench(lambda: graphed(x), warmup=50, rep=200, return_mode="median")
                ms_ref = triton.testing.do_bench(lambda model=ref: run_ref(model, x)[1], warmup=50, rep=200,
                                                 return_mode="median")
            for what, g, t, w in zip(("features", "output"), got, theirs, want):
                err, ref_err = rel_err(g, w), rel_err(t, w)
                tol = tolerance(dtype, ref_err)
                rows.append(dict(model=name, batch=batch, dtype=precision, what=what,
                                 err=err, ref_err=ref_err, tol=tol, ok=err <= tol,
                                 ms_ours=ms_ours, ms_ref=ms_ref))
                r = rows[-1]
                print(f"{name:28s} b={batch:<3d} {r['dtype']:9s} {what:8s} err {err:.2e}  ref {ref_err:.2e}  "
                      f"tol {tol:.2e}  {'ok' if r['ok'] else 'FAIL'}   ours {ms_ours:8.3f} ms  ref {ms_ref:8.3f} ms",
                      flush=True)
            save()
            del ref, ours


MODELS = {"vit-base": hf_vit_base, "clip-large": timm_clip_large, "dinov2-large": hf_dinov2_large,
          "clip-large-hf": hf_clip_large, "siglip-so400m": hf_siglip_so400m, "eva02-base": timm_eva02_base,
          "dinov3-large": hf_dinov3_large, "aimv2-large": hf_aimv2_large}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--models", default="vit-base,clip-large", help="comma-separated, from " + ", ".join(MODELS)
                        + " (default: %(default)s)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help="comma-separated, from " + ", ".join(PRECISIONS))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    args = parser.parse_args()
    models, precisions = args.models.split(","), args.precisions.split(",")
    for what, chosen, known in (("model", models, MODELS), ("precision", precisions, PRECISIONS)):
        for name in chosen:
            if name not in known:
                parser.error(f"unknown {what} {name!r}: expected one of {', '.join(known)}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"--batches must be comma-separated positive integers, got {args.batches!r}")
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows: list[dict] = []

    def save() -> None:
        """The rows so far, replaced atomically: a run cut short keeps what it checked."""
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                           triton=triton.__version__, rows=rows), indent=1))
            os.replace(tmp, args.json)

    for name in models:
        check_model(*MODELS[name](), rows, precisions, batches, save)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
