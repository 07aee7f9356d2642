"""FLOP and byte counts against values computed by hand."""

import pytest
import torch

from vit_triton.bench.costs import forward_costs, linear_cost, model_flops
from vit_triton.model import PRESETS, ViTConfig


def test_vit_base_flops_by_hand():
    # ViT-B/16 @ 224: T = 197 tokens, 196 patches, D = 768, F = 3072, 16x16x3 = 768 values a patch.
    patch = 2 * 196 * 768 * 768                      # 231_211_008
    qkv = 2 * 197 * 768 * 2304                       # 697_171_968
    scores_and_mix = 4 * 197 * 197 * 768             # 119_221_248
    proj = 2 * 197 * 768 * 768                       # 232_390_656
    mlp = 2 * 2 * 197 * 768 * 3072                   # 1_859_125_248
    head = 2 * 768 * 1000                            # 1_536_000
    assert patch + 12 * (qkv + scores_and_mix + proj + mlp) + head == 35_127_656_448
    assert model_flops(PRESETS["vit_base_patch16_224"]) == 35_127_656_448
    assert model_flops(PRESETS["vit_base_patch16_224"], batch=3) == 3 * 35_127_656_448


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("batch", [1, 7])
def test_kernel_flops_add_up_to_the_model(name, batch):
    cfg = PRESETS[name]
    assert sum(c.flops * c.count for c in forward_costs(cfg, batch, 2) if c.is_matmul) == model_flops(cfg, batch)


def test_linear_bytes_by_hand():
    # fc2 of ViT-B at batch 2 in bf16: x 394x3072, W 768x3072, y and residual 394x768, bias 768.
    c = linear_cost("fc2", 394, 768, 3072, 2, residual=True)
    assert c.bytes == 2 * (394 * 3072 + 768 * 3072 + 2 * 394 * 768 + 768) == 8_351_232
    assert c.flops == 2 * 394 * 768 * 3072


def test_forward_launches_of_a_clip_tower():
    cfg = PRESETS["vit_large_patch14_clip_336"]   # pre_norm, no head: 577 tokens, 24 blocks
    costs = {c.name: c for c in forward_costs(cfg, 1, 2)}
    assert "layer_norm pre" in costs and "linear head" not in costs
    assert costs["layer_norm"].count == 48 and costs["linear qkv"].count == 24
    assert costs["fused_attention"].bytes == 4 * 577 * 1024 * 2
    # Patch embed: pixels 3x336x336, weight 1024x588, tokens 577x1024, pos 577x1024, class token 1024.
    assert costs["patch_embed"].bytes == 2 * (3 * 336 * 336 + 1024 * 588 + 2 * 577 * 1024 + 1024)


def test_avg_pool_and_fc_norm_launches():
    cfg = ViTConfig(image_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=64,
                    pool="avg", fc_norm=True, num_classes=3)
    names = [c.name for c in forward_costs(cfg, 2, 4)]
    assert names[-3:] == ["token_mean", "layer_norm fc", "linear head"]
    costs = {c.name: c for c in forward_costs(cfg, 2, 4)}
    assert costs["token_mean"].flops == 2 * 16 * 64 and costs["layer_norm fc"].flops == 8 * 2 * 64
    assert "layer_norm final" not in names


def test_embed_norm_adds_the_position_table():
    # AIMv2: the patch embeddings' RMSNorm (weight only) adds the table: 16 patches of 64 a 32 px image
    cfg = ViTConfig(image_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=64, class_token=False,
                    pool="avg", norm="rmsnorm", embed_norm=True)
    costs = {c.name: c for c in forward_costs(cfg, 2, 4)}
    assert costs["layer_norm embed"].bytes == 4 * (2 * 32 * 64 + 64 + 16 * 64)
    assert costs["layer_norm embed"].dims["post_add"] == 16
    assert costs["patch_embed"].bytes == 4 * (2 * 3 * 32 * 32 + 64 * 192 + 32 * 64)


def test_a_relative_position_bias_adds_its_bytes_to_attention():
    # BEiT: each head's bias [H, T, T] in the model's dtype, read by every attention launch; no FLOPs counted
    plain = ViTConfig(image_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_dim=64)
    for mode in ("block", "shared"):
        cfg = ViTConfig(image_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_dim=64,
                        rel_pos_bias=mode, abs_pos_embed=False)
        ours, theirs = ({c.name: c for c in forward_costs(x, 3, 2)}["fused_attention"] for x in (cfg, plain))
        assert ours.bytes == theirs.bytes + 2 * 2 * 17 * 17 and ours.flops == theirs.flops
        assert ours.dims["bias"] and not theirs.dims["bias"]


def test_the_kernel_checks_of_a_relative_position_bias_model():
    # verify's per-kernel checks (and --kernels' timings) call the attention with the model's bias
    from vit_triton.bench.verify import kernel_checks
    from vit_triton.bench.workloads import forward_workloads

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ViTConfig(image_size=40, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=64,
                    rel_pos_bias="block", abs_pos_embed=False)
    (attention,) = [w for w in forward_workloads(cfg, 2, torch.float32, device)
                    if w.cost.kind == "fused_attention"]
    assert attention.inputs[1].shape == (2, 26, 26)
    checks = kernel_checks(cfg, 2, torch.float32, device)
    assert [c.name for c in checks if not c.ok] == []
