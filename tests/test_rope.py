"""Rotary embeddings against timm's and transformers': rope_reference (what the QKV projection computes) rotates as
they do, given their tables for a 3 x 5 patch grid; model/rope.py builds those tables itself, at any grid. Both
bit for bit in float32."""

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from transformers import DINOv3ViTConfig, DINOv3ViTModel
from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTRopePositionEmbedding, apply_rotary_pos_emb

from tests.numerics import DEVICE
from vit_triton.kernels.linear import check_rope
from vit_triton.model import ViTConfig
from vit_triton.model.reference import rope_reference
from vit_triton.model.rope import RopeTables, rope_tables

GRID = (3, 5)
GRIDS = [GRID, (7, 4)]   # beside each model's own grid
# timm's Eva models with rotary embeddings, shrunk to one block: (model, patch size, width, heads, rotate_half,
# prefix tokens). EVA02 and the RoPE ViTs (axial, mixed: a table per head) pair channels (2i, 2i + 1); DINOv3
# pairs them a half apart.
TIMM_MODELS = [
    ("eva02_tiny_patch14_224", 14, 192, 3, False, 1),
    ("vit_small_patch16_rope_224", 16, 96, 3, False, 1),
    ("vit_small_patch16_rope_mixed_224", 16, 128, 2, False, 1),
    ("vit_betwixt_patch16_rope_reg4_gap_256", 16, 128, 4, False, 4),
    ("vit_small_patch16_dinov3", 16, 128, 2, True, 5),
    ("vit_pe_core_tiny_patch16_384", 16, 96, 3, False, 1),   # axial with rope_grid_offset 1
]


def sdpa_inputs(attn, x, rope, monkeypatch):
    """The q and k [B, T, H, Dh] that timm's attention module hands to F.scaled_dot_product_attention."""
    seen = []
    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kwargs: seen.append((q, k)) or v)
        attn(x, rope=rope)
    return [t.transpose(1, 2) for t in seen[0]]


@pytest.mark.parametrize("name, patch, width, heads, half, prefix", TIMM_MODELS, ids=[m[0] for m in TIMM_MODELS])
def test_timm(name, patch, width, heads, half, prefix, monkeypatch):
    model = timm.create_model(name, pretrained=False, img_size=(GRID[0] * patch, GRID[1] * patch), embed_dim=width,
                              num_heads=heads, depth=1).eval()
    attn = model.blocks[0].attn
    attn.fused_attn = True
    assert (attn.rotate_half, attn.num_prefix_tokens) == (half, prefix)
    rope = model.rope.get_embed(shape=list(GRID))   # [T_rot, 2 Dh] = [sin, cos]; mixed: [depth, H, T_rot, 2 Dh]
    rope = rope[0] if rope.dim() == 4 else rope
    assert rope.dtype == torch.float32 and rope.shape[-2:] == (GRID[0] * GRID[1], 2 * width // heads)
    sin, cos = rope.chunk(2, -1)
    x = torch.randn(2, prefix + GRID[0] * GRID[1], width)
    with torch.no_grad():
        (q, k), (rotated_q, rotated_k) = (sdpa_inputs(attn, x, r, monkeypatch) for r in (None, rope))
    assert torch.equal(rope_reference(q, cos, sin, half, prefix), rotated_q)
    assert torch.equal(rope_reference(k, cos, sin, half, prefix), rotated_k)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_transformers_dinov3(head_dim):
    # DINOv3ViTModel: rotate_half pairs; the class token and the 4 registers before the patches stay unrotated.
    config = DINOv3ViTConfig(hidden_size=2 * head_dim, num_attention_heads=2, patch_size=16, num_register_tokens=4)
    cos, sin = DINOv3ViTRopePositionEmbedding(config)(torch.randn(1, 3, GRID[0] * 16, GRID[1] * 16))
    assert cos.dtype == torch.float32 and cos.shape == (GRID[0] * GRID[1], head_dim)
    q, k = torch.randn(2, 2, 5 + GRID[0] * GRID[1], 2, head_dim).unbind(1)   # [B, T, H, Dh]
    rotated_q, rotated_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(rope_reference(q, cos, sin, half=True, prefix=5), rotated_q.transpose(1, 2))
    assert torch.equal(rope_reference(k, cos, sin, half=True, prefix=5), rotated_k.transpose(1, 2))


def timm_rope_config(model) -> ViTConfig:
    """Our config's rope fields from those timm's Eva (created on the CPU) built its rope module with."""
    r, attn = model.rope, model.blocks[0].attn
    kind = {"RotaryEmbeddingCat": "axial", "RotaryEmbeddingMixed": "mixed",
            "RotaryEmbeddingDinoV3": "centered"}[type(r).__name__]
    if kind == "axial":   # what Eva passes; the only settings our "axial" covers
        assert (r.in_pixels, getattr(r, "grid_type", "index")) == (False, "index")   # timm 1.0.29 has no grid_type
    if kind == "centered":
        assert (r.normalize_coords, r.min_period, r.max_period) == ("separate", None, None)
    return ViTConfig(image_size=model.patch_embed.img_size[0], patch_size=model.patch_embed.patch_size[0],
                     embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads, rope=kind,
                     rope_theta=r.temperature, rope_half=attn.rotate_half, rope_xy=r.grid_indexing == "xy",
                     rope_offset=getattr(r, "grid_offset", 0.0), rope_ref_grid=getattr(r, "ref_feat_shape", None),
                     rope_cpu=not model.dynamic_img_size and kind != "mixed")   # mixed: on each forward's device


def assert_tables_equal(ours, theirs):
    """ours (cos, sin) against theirs [..., 2 Dh] = [sin, cos]."""
    sin, cos = theirs.chunk(2, -1)
    assert all(t.dtype == torch.float32 and t.is_contiguous() and t.device == theirs.device for t in ours)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)


@pytest.mark.parametrize("name, patch, width, heads, half, prefix", TIMM_MODELS, ids=[m[0] for m in TIMM_MODELS])
def test_timm_tables(name, patch, width, heads, half, prefix):
    args = dict(pretrained=False, embed_dim=width, num_heads=heads, depth=2)
    fixed = timm.create_model(name, dynamic_img_size=False, **args).eval()   # its table built at creation
    dynamic = timm.create_model(name, dynamic_img_size=True, **args).eval()   # get_embed at each input's grid
    if hasattr(fixed.rope, "freqs"):   # mixed: learned, a table per block and head
        with torch.no_grad():
            fixed.rope.freqs.normal_()
    dynamic.load_state_dict(fixed.state_dict())
    cfg, dynamic_cfg = timm_rope_config(fixed), timm_rope_config(dynamic)
    fixed, dynamic = fixed.to(DEVICE), dynamic.to(DEVICE)
    assert cfg.rope_half == half
    freqs = fixed.rope.freqs.detach() if cfg.rope == "mixed" else None
    own = fixed.patch_embed.grid_size
    assert own == cfg.grid and (cfg.rope == "mixed") == (fixed.rope.get_embed().dim() == 4)
    assert_tables_equal(rope_tables(cfg, own, DEVICE, freqs), fixed.rope.get_embed())
    for grid in [own, *GRIDS]:
        assert_tables_equal(rope_tables(dynamic_cfg, grid, DEVICE, freqs), dynamic.rope.get_embed(shape=list(grid)))


@pytest.mark.parametrize("head_dim", [32, 64])
def test_transformers_dinov3_tables(head_dim):
    config = DINOv3ViTConfig(hidden_size=2 * head_dim, num_attention_heads=2, intermediate_size=64, patch_size=16,
                             num_hidden_layers=1, num_register_tokens=4)
    module = DINOv3ViTModel(config).eval().rope_embeddings.to(DEVICE)   # eval: no coordinate augmentation
    cfg = ViTConfig(image_size=config.image_size, patch_size=16, embed_dim=config.hidden_size, depth=1, num_heads=2,
                    reg_tokens=4, rope="centered_inv_freq", rope_theta=config.rope_theta, rope_half=True)
    for grid in [cfg.grid, *GRIDS]:
        cos, sin = module(torch.randn(1, 3, grid[0] * 16, grid[1] * 16, device=DEVICE))
        assert_tables_equal(rope_tables(cfg, grid, DEVICE), torch.cat([sin, cos], -1))


def test_timm_and_transformers_dinov3_angles_differ_in_last_bits():
    timm_cfg = ViTConfig(embed_dim=128, num_heads=2, rope="centered", rope_theta=100.0, rope_half=True)
    hf_cfg = ViTConfig(**{**timm_cfg.to_dict(), "rope": "centered_inv_freq"})
    (cos, sin), (hf_cos, hf_sin) = rope_tables(timm_cfg, (14, 14)), rope_tables(hf_cfg, (14, 14))
    assert not torch.equal(cos, hf_cos) and not torch.equal(sin, hf_sin)
    assert torch.allclose(cos, hf_cos, rtol=0, atol=1e-6) and torch.allclose(sin, hf_sin, rtol=0, atol=1e-6)


def test_fixed_tables_are_kept_per_grid_and_device(monkeypatch):
    tables = RopeTables(ViTConfig(embed_dim=128, num_heads=2, rope="axial", rope_ref_grid=[16, 16]))
    assert tables.freqs_shape is None
    with torch.inference_mode():   # as the pipelines run it: the kept tables are still normal tensors
        cos, sin = tables(GRID)
    assert not cos.is_inference() and tables(GRID, "cpu")[0] is cos and tables(GRID)[1] is sin
    assert torch.equal(cos, rope_tables(tables.cfg, GRID)[0]) and tables((7, 4))[0].shape == (28, 64)
    assert list(tables.tables) == [(GRID, torch.device("cpu")), ((7, 4), torch.device("cpu"))]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)   # in a compiled graph: computed, not kept
    assert tables((2, 2))[0] is not tables((2, 2))[0] and len(tables.tables) == 2


def test_mixed_tables_follow_the_learned_freqs():
    cfg = ViTConfig(embed_dim=128, depth=2, num_heads=2, rope="mixed", rope_xy=True)
    tables = RopeTables(cfg)
    freqs = torch.nn.Parameter(torch.randn(tables.freqs_shape))   # timm's rope.freqs [2, depth, H, Dh / 2]
    assert tables(GRID, freqs=freqs)[0].requires_grad   # training: computed at each call, differentiably
    freqs.requires_grad_(False)   # as at inference: kept, and computed again when the frequencies change
    cos, sin = tables(GRID, freqs=freqs)
    assert cos.shape == (2, 2, 15, 64) and not cos.requires_grad and tables(GRID, freqs=freqs)[0] is cos
    # A block's slice is what its QKV projection takes: contiguous, one table per head.
    assert check_rope((cos[1], sin[1]), 2 * 16, 3 * 2 * 64, False, 1, "none", None, 1.0).head_stride == 15 * 64

    def fresh():
        return [t.detach() for t in rope_tables(cfg, GRID, freqs=freqs)]

    with torch.no_grad():
        freqs.mul_(-2)   # in place: the version counter moves
    assert tables(GRID, freqs=freqs)[0] is cos and torch.equal(cos, fresh()[0]) and torch.equal(sin, fresh()[1])
    with torch.no_grad():
        freqs.add_(1)
    tables.refresh(freqs)   # what a CUDA graph runner does before a replay: every stale table, in place
    assert torch.equal(cos, fresh()[0]) and torch.equal(sin, fresh()[1])


@pytest.mark.parametrize("kw, match", [
    (dict(rope="sincos"), r"rope must be one of \('none', 'axial', 'mixed', 'centered', 'centered_inv_freq'\), "
                          r"got 'sincos'"),
    (dict(rope="centered", rope_ref_grid=(16, 16)), r"rope_ref_grid must be None or \(rows, cols\) of at least 1 "
                                                    r"with rope 'axial', got \(16, 16\) with rope 'centered'"),
    (dict(rope="axial", rope_ref_grid=(16,)), "rope_ref_grid must be None or"),
    (dict(rope="axial", rope_ref_grid=(16, 0)), "rope_ref_grid must be None or"),
    (dict(rope="axial", embed_dim=36, num_heads=2), "rope needs a head dim that is a multiple of 4 and rope_theta > 0, "
                                                    "got head dim 18"),
    (dict(rope="centered", rope_theta=0), "rope_theta > 0"),
])
def test_bad_rope_config(kw, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**kw)


def test_rope_tables_bad_arguments():
    with pytest.raises(ValueError, match="rope 'none'"):
        RopeTables(ViTConfig())
    with pytest.raises(ValueError, match="rope 'mixed' needs the freqs"):
        rope_tables(ViTConfig(rope="mixed"), GRID)
    with pytest.raises(ValueError, match="rope 'axial' takes no freqs"):
        rope_tables(ViTConfig(rope="axial"), GRID, freqs=torch.zeros(2, 12, 12, 32))


def test_config_from_its_json():
    cfg = ViTConfig(rope="axial", rope_theta=100, rope_xy=True, rope_offset=1, rope_ref_grid=[16, 16])
    assert (cfg.rope_theta, cfg.rope_ref_grid) == (100.0, (16, 16)) and isinstance(cfg.rope_theta, float)
    assert ViTConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg
