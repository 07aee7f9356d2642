"""rope_reference (what fused_attention's rotary embeddings compute) against timm's and transformers' own rotation,
with the tables their rope modules build for a 3 x 5 patch grid: the same float32 values, bit for bit."""

import pytest
import timm
import torch
import torch.nn.functional as F
from transformers import DINOv3ViTConfig
from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTRopePositionEmbedding, apply_rotary_pos_emb

from vit_triton.model.reference import rope_reference

GRID = (3, 5)
# timm's Eva models with rotary embeddings, shrunk to one block: (model, patch size, width, heads, rotate_half,
# prefix tokens). EVA02 and the RoPE ViTs (axial, mixed: a table per head) pair channels (2i, 2i + 1); DINOv3
# pairs them a half apart.
TIMM_MODELS = [
    ("eva02_tiny_patch14_224", 14, 192, 3, False, 1),
    ("vit_small_patch16_rope_224", 16, 96, 3, False, 1),
    ("vit_small_patch16_rope_mixed_224", 16, 128, 2, False, 1),
    ("vit_betwixt_patch16_rope_reg4_gap_256", 16, 128, 4, False, 4),
    ("vit_small_patch16_dinov3", 16, 128, 2, True, 5),
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
