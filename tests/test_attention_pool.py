"""AttentionPool with the random weights of timm's AttentionPoolLatent and of SigLIP's and AIMv2's pooling heads
(transformers), against those modules, and the PyTorch reference of the same heads against timm's and AIMv2's."""

import copy
from functools import partial

import pytest
import torch
from timm.layers import AttentionPoolLatent
from torch import nn
from transformers import Aimv2VisionConfig, SiglipVisionConfig
from transformers.models.aimv2.modeling_aimv2 import Aimv2AttentionPoolingHead
from transformers.models.siglip.modeling_siglip import SiglipMultiheadAttentionPoolingHead

from tests.kernels.checks import raises_value_error, tf32_matmuls
from tests.numerics import DEVICE, assert_close, randomize_, rel_err
from vit_triton import ops
from vit_triton.model import AttentionPool, attention_pool
from vit_triton.model.reference import attention_pool_reference

EPS = 1e-6
# (width, heads, MLP width): heads of 32, and of 72 as in SigLIP SO400M
WIDTHS = {"Dh32": (96, 3, 192), "Dh72": (144, 2, 288)}
DTYPES = [torch.float32, torch.bfloat16]


def timm_head(dim, heads, mlp_dim, act, latent_len):
    """timm's head with random weights (randomize_ after the default init), and ours loaded from its state dict."""
    theirs = randomize_(AttentionPoolLatent(dim, num_heads=heads, mlp_ratio=mlp_dim / dim, latent_len=latent_len,
                                            norm_layer=partial(nn.LayerNorm, eps=EPS),
                                            act_layer=partial(nn.GELU, approximate="tanh" if act == "gelu_tanh"
                                                              else "none")))
    params = theirs.state_dict()
    params["latent"] = params["latent"][0]   # [1, L, D] -> [L, D]
    return theirs.eval(), params


def siglip_head(dim, heads, mlp_dim):
    """SigLIP's head with random weights, and its state dict in AttentionPool's names."""
    config = SiglipVisionConfig(hidden_size=dim, num_attention_heads=heads, intermediate_size=mlp_dim,
                                layer_norm_eps=EPS, hidden_act="gelu_pytorch_tanh")
    theirs = randomize_(SiglipMultiheadAttentionPoolingHead(config))
    p = theirs.state_dict()
    in_w, in_b = p["attention.in_proj_weight"], p["attention.in_proj_bias"]
    params = {"latent": p["probe"][0], "q.weight": in_w[:dim], "q.bias": in_b[:dim], "kv.weight": in_w[dim:],
              "kv.bias": in_b[dim:], "proj.weight": p["attention.out_proj.weight"],
              "proj.bias": p["attention.out_proj.bias"], "norm.weight": p["layernorm.weight"],
              "norm.bias": p["layernorm.bias"]}
    params |= {k: v for k, v in p.items() if k.startswith("mlp.")}
    return theirs.eval(), params


def aimv2_head(dim, heads):
    """AIMv2's head (its k_proj and v_proj with biases) with random weights, and its state dict in AttentionPool's
    names: no q, no norm, no mlp."""
    theirs = randomize_(Aimv2AttentionPoolingHead(Aimv2VisionConfig(hidden_size=dim, num_attention_heads=heads,
                                                                    qkv_bias=True)))
    p = theirs.state_dict()
    params = {"latent": p["cls_token"][0], "kv.weight": torch.cat([p["k_proj.weight"], p["v_proj.weight"]]),
              "kv.bias": torch.cat([p["k_proj.bias"], p["v_proj.bias"]]), "proj.weight": p["output_proj.weight"],
              "proj.bias": p["output_proj.bias"]}
    pool = AttentionPool(dim, heads, 4 * dim, query_proj=False, mlp=False)
    pool.load_state_dict(params)
    return theirs.eval(), params, pool


def ours_from(params, heads, act, dtype):
    dim, mlp_dim = params["mlp.fc1.weight"].shape[::-1]
    pool = AttentionPool(dim, heads, mlp_dim, act=act, norm_eps=EPS, latent_len=params["latent"].shape[0])
    pool.load_state_dict(params)
    return pool.to(DEVICE, dtype)


def assert_matches(ours, theirs, tokens, dtype):
    """ours(tokens) within the tolerance rule: weights and tokens rounded to dtype, the reference theirs in float64
    on the CPU, PyTorch's own error that of theirs in dtype."""
    theirs, tokens = theirs.to(DEVICE, dtype), tokens.to(DEVICE, dtype)
    ref = copy.deepcopy(theirs).to("cpu", torch.float64)(tokens.to("cpu", torch.float64))
    assert_close(ours(tokens), ref, dtype, theirs(tokens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("act, latent_len", [("gelu", 1), ("gelu_tanh", 2)])
def test_matches_timm(width, dtype, act, latent_len):
    torch.manual_seed(0)
    dim, heads, mlp_dim = WIDTHS[width]
    theirs, params = timm_head(dim, heads, mlp_dim, act, latent_len)
    assert_matches(ours_from(params, heads, act, dtype), theirs, torch.randn(3, 37, dim), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_siglip(width, dtype):
    torch.manual_seed(1)
    dim, heads, mlp_dim = WIDTHS[width]
    theirs, params = siglip_head(dim, heads, mlp_dim)
    assert_matches(ours_from(params, heads, "gelu_tanh", dtype), theirs, torch.randn(3, 51, dim), dtype)


@pytest.mark.parametrize("latent_len", [1, 2])
def test_reference_matches_timm(latent_len):
    torch.manual_seed(2)
    theirs, params = timm_head(96, 3, 192, "gelu", latent_len)
    tokens = torch.randn(3, 37, 96, dtype=torch.float64)
    params = {"head." + k: v.double() for k, v in params.items()}
    ours = attention_pool_reference(params, "head.", tokens, 3, EPS, "gelu")
    assert rel_err(ours, theirs.double()(tokens)) < 1e-13


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_aimv2(dtype):
    torch.manual_seed(5)
    dim, heads, _ = WIDTHS["Dh72"]
    theirs, params, ours = aimv2_head(dim, heads)
    tokens = torch.randn(3, 51, dim, dtype=torch.float64)
    reference = attention_pool_reference({"head." + k: v.double() for k, v in params.items()}, "head.", tokens, heads,
                                         EPS, "gelu")
    assert rel_err(reference, copy.deepcopy(theirs).double()(tokens)) < 1e-13
    assert_matches(ours.to(DEVICE, dtype), theirs, tokens.float(), dtype)


def test_aimv2_query_is_rounded_to_tf32_by_attention(monkeypatch):
    # No kernel wrote AIMv2's query (the latent itself) rounded to tf32: with float32 matmuls on tf32 attention must
    # round it, as it does when no operand comes rounded: the same bits as every kernel rounding its own operands.
    torch.manual_seed(6)
    _, _, pool = aimv2_head(96, 3)
    pool = pool.to(DEVICE)
    tokens = torch.randn(2, 37, 96, device=DEVICE)
    with tf32_matmuls():
        flagged = pool(tokens)
        pool.kv.tf32_output = pool.proj.tf32_input = False
        monkeypatch.setattr(attention_pool, "attention", lambda kv, q=None, **flags: ops.attention(kv, q))
        assert torch.equal(pool(tokens), flagged)


def test_query_kept_until_its_inputs_change(monkeypatch):
    # q(latent) runs once, then again only after latent, q.weight or q.bias change in place, or the float32
    # matmul precision (its tf32 rounding) changes; the output follows each change.
    torch.manual_seed(3)
    theirs, params = timm_head(96, 3, 192, "gelu", 1)
    pool = ours_from(params, 3, "gelu", torch.float32)
    calls = []
    forward = pool.q.forward
    monkeypatch.setattr(pool.q, "forward", lambda x: calls.append(1) or forward(x))
    tokens = torch.randn(2, 37, 96)

    def check(computed):
        calls.clear()
        with torch.no_grad():   # inference: where autograd records the pool (training) the query is computed anew
            assert_close(pool(tokens.to(DEVICE)), theirs.double()(tokens.double()), torch.float32)
        assert len(calls) == computed

    check(1)
    check(0)
    for ours, timm_param in ((pool.latent, theirs.latent), (pool.q.weight, theirs.q.weight),
                             (pool.q.bias, theirs.q.bias)):
        with torch.no_grad():
            ours.mul_(1.5)
            timm_param.mul_(1.5)
        check(1)
    calls.clear()
    with tf32_matmuls(), torch.no_grad():
        pool(tokens.to(DEVICE))
    assert len(calls) == 1
    calls.clear()
    pool(tokens.to(DEVICE))
    pool(tokens.to(DEVICE))
    assert len(calls) == 2   # recorded by autograd: computed at each call, in the graph the backward goes through


def test_inference_tensors_compute_the_query_each_call(monkeypatch):
    torch.manual_seed(4)
    theirs, params = timm_head(96, 3, 192, "gelu", 1)
    tokens = torch.randn(2, 37, 96)
    with torch.inference_mode():
        pool = ours_from(params, 3, "gelu", torch.float32)
        pool(tokens.to(DEVICE))
        pool.q.weight.mul_(1.5)   # no version counter tells
        theirs.q.weight.mul_(1.5)
        assert_close(pool(tokens.to(DEVICE)), theirs.double()(tokens.double()), torch.float32)


def test_torch_compile_traces_it():
    # One graph (a graph break would raise) in which q(latent) is an op; bit for bit the eager result.
    pool = randomize_(AttentionPool(96, 3, 192, device=DEVICE)).to(torch.bfloat16).eval()
    compiled = torch.compile(pool, fullgraph=True)
    with torch.inference_mode():
        for batch in (2, 3):   # the second batch size recompiles with a symbolic batch
            tokens = torch.randn(batch, 37, 96, device=DEVICE).bfloat16()
            torch.testing.assert_close(compiled(tokens), pool(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=5), "dim 96 must be a multiple of num_heads 5"),
    (dict(act="relu"), "act must be one of ('gelu', 'gelu_tanh', 'quick_gelu', 'swiglu'), got 'relu'"),
])
def test_bad_arguments(change, message):
    with raises_value_error(message):
        AttentionPool(**dict(dim=96, num_heads=3, mlp_dim=192) | change)
