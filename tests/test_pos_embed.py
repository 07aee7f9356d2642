"""Position embeddings at another patch grid: pos_embed.resample equals each library's own resampling bit for
bit, and a model resamples once per grid, again after pos_embed changes, and matches the reference there."""

import pytest
import torch

from tests.numerics import DEVICE, assert_close, randomize_
from vit_triton.model import ViT, ViTConfig, pos_embed
from vit_triton.model.config import POS_RESAMPLES
from vit_triton.model.pos_embed import resample
from vit_triton.model.reference import reference_forward

DIM, PATCH, OLD = 24, 8, (4, 4)   # tables of a 32 x 32 px checkpoint
GRIDS = [(3, 5), (6, 2), (7, 7), (4, 4)]   # fewer and more rows and columns; the table's own grid
DTYPES = [torch.float32, torch.bfloat16]
grids = pytest.mark.parametrize("grid", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])


@dtypes
@grids
@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_timm_resample_abs_pos_embed(prefix, grid, dtype):
    # VisionTransformer._pos_embed with dynamic_img_size: the prefix rows are kept unless no_embed_class (0).
    from timm.layers import resample_abs_pos_embed

    table = torch.randn(1, prefix + 16, DIM).to(dtype)
    theirs = resample_abs_pos_embed(table, new_size=grid, old_size=OLD, num_prefix_tokens=prefix)
    assert torch.equal(resample(table[0], prefix, OLD, grid, "bicubic_float32_antialias"), theirs[0])


def _embeddings(family: str):
    """A transformers embeddings module of a 32 x 32 px, patch-8 model: (module, its [1, T, D] table, our style)."""
    import transformers

    name, config, style = {
        "vit": ("ViTEmbeddings", "ViTConfig", "bicubic"),
        "deit": ("DeiTEmbeddings", "DeiTConfig", "bicubic"),
        "dinov2": ("Dinov2Embeddings", "Dinov2Config", "bicubic_float32"),
        "dinov2_with_registers": ("Dinov2WithRegistersEmbeddings", "Dinov2WithRegistersConfig",
                                  "bicubic_float32_antialias"),
        "clip": ("CLIPVisionEmbeddings", "CLIPVisionConfig", "bicubic"),
        "siglip": ("SiglipVisionEmbeddings", "SiglipVisionConfig", "bicubic"),
        "vit_mae": ("ViTMAEEmbeddings", "ViTMAEConfig", "bicubic"),
    }[family]
    module_path = f"transformers.models.{family}.modeling_{family}"
    cls = getattr(__import__(module_path, fromlist=[name]), name)
    module = cls(getattr(transformers, config)(image_size=32, patch_size=PATCH, hidden_size=DIM))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    table = module.position_embedding.weight[None] if hasattr(module, "position_embedding") \
        else module.position_embeddings
    return module, table, style


FAMILIES = ["vit", "deit", "dinov2", "dinov2_with_registers", "clip", "siglip", "vit_mae"]


@dtypes
@grids
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_interpolate_pos_encoding(family, grid, dtype):
    module, table, style = _embeddings(family)
    module.to(dtype)
    table = table.to(dtype)
    prefix = table.shape[1] - 16
    with torch.no_grad():
        tokens = torch.empty(1, prefix + grid[0] * grid[1], DIM, dtype=dtype)
        theirs = module.interpolate_pos_encoding(tokens, grid[0] * PATCH, grid[1] * PATCH)
        ours = resample(table[0].detach(), prefix, OLD, grid, style)
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs[0]), f"{family} {style}"


@grids
def test_the_styles_differ(grid):
    table = torch.randn(1 + 16, DIM).bfloat16()
    results = [resample(table, 1, OLD, grid, style) for style in POS_RESAMPLES]
    for i in range(len(results)):
        for j in range(i):
            assert torch.equal(results[i], results[j]) == (grid == OLD), (POS_RESAMPLES[i], POS_RESAMPLES[j])
    assert torch.equal(results[0][:1], table[:1])   # the prefix row as it is


def _model(dtype=torch.float32, **kw) -> ViT:
    cfg = ViTConfig(image_size=24, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=96, **kw)
    return randomize_(ViT(cfg, device=DEVICE)).to(dtype).eval()


def _check(model: ViT, pixels: torch.Tensor) -> torch.Tensor:
    """forward_features against the float64 reference with the model's current parameters."""
    out = model.forward_features(pixels)
    params = model.state_dict()
    ref = reference_forward(model.config, {k: v.double() for k, v in params.items()}, pixels.double(), True)
    assert_close(out, ref, out.dtype, reference_forward(model.config, params, pixels.to(out.dtype), True))
    return out


def test_resampled_once_per_grid_and_again_after_pos_embed_changes(monkeypatch):
    calls = []
    monkeypatch.setattr(pos_embed, "resample", lambda *args: calls.append(args[3]) or resample(*args))
    # Frozen, as at inference: a table autograd records (training) is resampled at each call, differentiably.
    model = _model(reg_tokens=2, num_classes=5).requires_grad_(False)
    wide, tall = torch.randn(2, 3, 16, 40, device=DEVICE), torch.randn(1, 3, 32, 8, device=DEVICE)
    with torch.inference_mode():   # as the pipelines run it: the kept tables are still normal tensors
        first = _check(model, wide)
        model(wide)
        model(torch.randn(1, 3, 24, 24, device=DEVICE))   # its own grid: the table as stored
    _check(model, tall)
    assert calls == [(2, 5), (4, 1)]
    kept = model.pos_tables.tables[(2, 5)][0]
    assert not kept.is_inference() and not kept.requires_grad

    with torch.no_grad():
        model.pos_embed.mul_(-1.5)   # in place: the version counter moves
    assert not torch.equal(_check(model, wide), first)
    assert calls == [(2, 5), (4, 1), (2, 5)]
    assert model.pos_tables.tables[(2, 5)][0] is kept   # recomputed into the same memory

    model.load_state_dict(_model(reg_tokens=2, num_classes=5).state_dict())
    model.refresh_pos_embed()   # what a CUDA graph runner does before a replay: every stale grid, in place
    assert calls == [(2, 5), (4, 1), (2, 5), (2, 5), (4, 1)]
    prefix = model.config.num_prefix_tokens
    assert torch.equal(kept, resample(model.pos_embed.detach(), prefix, (3, 3), (2, 5), "bicubic_float32_antialias"))
    _check(model, wide)
    assert len(calls) == 5

    model.to(torch.bfloat16)   # another tensor: a new table in the new dtype
    _check(model, wide)
    assert len(calls) == 6 and model.pos_tables.tables[(2, 5)][0].dtype == torch.bfloat16

    model.pos_embed.requires_grad_(True)   # training: resampled at each call, in the graph autograd records
    assert model.pos_tables(model.pos_embed, (2, 5)).requires_grad
    model(wide)
    assert len(calls) == 8


@pytest.mark.parametrize("shape", [(1, 3, 7, 24), (1, 3, 24, 5), (1, 3, 0, 24)])
def test_an_image_smaller_than_a_patch(shape):
    with pytest.raises(ValueError, match=rf"image height and width must be at least the patch size 8, "
                                         rf"got {shape[2]}x{shape[3]}"):
        _model()(torch.zeros(shape, device=DEVICE))


def test_pixels_past_the_last_whole_patch_are_not_read():
    """As a strided convolution: 30 x 21 pixels are 3 x 2 patches, the same as the first 24 x 16 of them."""
    model = _model()
    pixels = torch.randn(2, 3, 30, 21, device=DEVICE)
    cropped = pixels[:, :, :24, :16].contiguous()
    assert torch.equal(model.forward_features(pixels), model.forward_features(cropped))


def test_an_empty_batch_at_another_size():
    model = _model(dist_token=True, num_classes=3)
    assert model.forward_features(torch.zeros(0, 3, 16, 40, device=DEVICE)).shape == (0, 2 + 2 * 5, 64)
