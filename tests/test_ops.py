"""The torch.library ops: their fake (meta) functions agree with the kernels, and torch.compile
traces a whole model into one graph whose output equals the eager forward bit for bit."""

import contextlib

import pytest
import torch

from tests.kernels.checks import tf32_matmuls
from tests.numerics import DEVICE, randomize_
from vit_triton import ops
from vit_triton.model import ViT, ViTConfig
from vit_triton.model.layers import Linear

DT = torch.bfloat16


def _r(*shape, dtype=DT):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _qkv(B, T, H, Dh):
    return _r(B, T, 3, H, Dh).unbind(2)   # strided views, as the model passes them


def _rope(*shape):
    """cos, sin [(H,) T_rot, Dh] float32 tables."""
    angles = _r(*shape, dtype=torch.float32)
    return angles.cos(), angles.sin()


F32 = torch.float32
CASES = {
    "linear": (ops._linear, lambda: (_r(37, 48), _r(40, 48), _r(40), "gelu", _r(37, 40), 0.5, False, False)),
    "linear-no-bias": (ops._linear, lambda: (_r(5, 32, dtype=F32), _r(24, 32, dtype=F32), None, "none", None, 1.0,
                                             False, False)),
    "linear-strided-x": (ops._linear, lambda: (_r(9, 3, 32)[:, 1], _r(16, 32), _r(16), "quick_gelu", None, 1.0,
                                               False, False)),
    "linear-tf32": (ops._linear, lambda: (_r(37, 48, dtype=F32), _r(40, 48, dtype=F32), _r(40, dtype=F32), "gelu",
                                          None, 1.0, True, True)),
    "linear-swiglu": (ops._linear, lambda: (_r(37, 48), _r(80, 48), _r(80), "swiglu", _r(37, 40), 0.5, False, False)),
    "linear-rope": (ops._linear, lambda: (_r(38, 48), _r(96, 48), _r(96), "none", None, 1.0, False, False,
                                          *_rope(18, 16), False, 1)),
    "linear-rope-half-per-head": (ops._linear, lambda: (_r(14, 48, dtype=F32), _r(192, 48, dtype=F32), None, "none",
                                                        None, 1.0, False, True, *_rope(2, 7, 32), True, 0)),
    "linear_partials": (ops._linear_partials, lambda: (_r(37, 48), _r(40, 48), _r(40), 3, False)),
    "linear_partials-tf32": (ops._linear_partials, lambda: (_r(37, 48, dtype=F32), _r(40, 48, dtype=F32), None, 2,
                                                            True)),
    "layer_norm": (ops._layer_norm, lambda: (_r(21, 40), _r(40), _r(40), 1e-6, False)),
    "layer_norm-tf32": (ops._layer_norm, lambda: (_r(21, 40, dtype=F32), _r(40, dtype=F32), _r(40, dtype=F32), 1e-6,
                                                  True)),
    "layer_norm-rms-no-bias": (ops._layer_norm, lambda: (_r(21, 40), _r(40), None, 1e-6, False, True)),
    "add_layer_norm": (ops._add_layer_norm, lambda: (_r(21, 40), _r(2, 21, 40, dtype=F32), _r(40), _r(40), 1e-6,
                                                     False)),
    "add_layer_norm-rms-no-bias": (ops._add_layer_norm, lambda: (_r(21, 40), _r(2, 21, 40, dtype=F32), _r(40), None,
                                                                 1e-6, False, True)),
    "attention": (ops._attention, lambda: (_r(2, 19, 3, 3, 16), None, None, False, False)),
    "attention-scale": (ops._attention, lambda: (_r(1, 5, 3, 2, 32), None, 0.3, False, False)),
    "attention-pool": (ops._attention, lambda: (_r(2, 19, 2, 3, 16), _r(1, 1, 3, 16), None, False, False)),
    "attention-tf32": (ops._attention, lambda: (_r(2, 7, 3, 2, 16, dtype=F32), None, None, True, True)),
    "attention-bias": (ops._attention, lambda: (_r(2, 19, 3, 3, 16), None, None, False, False,
                                                _r(3, 19, 19, dtype=F32))),
    "attention-bias-16-bit": (ops._attention, lambda: (_r(1, 21, 3, 2, 16), None, 0.3, False, False, _r(2, 21, 21))),
    "linear-layer_scale-drop_path": (ops._linear, lambda: (_r(38, 48), _r(40, 48), _r(40), "none", _r(38, 40), 1.0,
                                                           False, False, None, None, False, 0, _r(40),
                                                           _r(38, dtype=F32).abs())),
    "linear_pre": (ops._linear_pre, lambda: (_r(37, 48), _r(40, 48), _r(40), "gelu", False, False)),
    "linear_pre-swiglu": (ops._linear_pre, lambda: (_r(37, 48), _r(80, 48), _r(80), "swiglu", False, False)),
    "mlp": (ops._mlp, lambda: (_r(37, 48), _r(96, 48), _r(96), _r(48, 96), _r(48), "quick_gelu", _r(37, 48), None,
                               None, False)),
    "mlp-swiglu-layer_scale": (ops._mlp, lambda: (_r(37, 48), _r(96, 48), None, _r(48, 48), None, "swiglu",
                                                  _r(37, 48), _r(48), _r(37, dtype=F32).abs(), False)),
    "patch_embed": (ops._patch_embed, lambda: (_r(2, 3, 16, 24, dtype=torch.float32), _r(32, 3, 8, 8), _r(32),
                                               _r(7, 32), _r(1, 32))),
    "patch_embed-bare": (ops._patch_embed, lambda: (_r(1, 3, 8, 8), _r(16, 3, 4, 4), None, None, None)),
    "token_mean": (ops._token_mean, lambda: (_r(3, 11, 24), 1)),
}


# The ops that autograd records (a backward registered); the others are inference-only.
TRAINED = (ops._linear, ops._linear_pre, ops._mlp, ops._layer_norm, ops._attention, ops._patch_embed, ops._token_mean)


@pytest.mark.parametrize("case", CASES)
def test_op_registration(case):
    """Schema, fake tensor (shape, dtype, strides) and dispatch, as torch.library checks them."""
    op, make = CASES[case]
    with tf32_matmuls() if case.endswith("-tf32") else contextlib.nullcontext():
        args = make()
        utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
        # every input requiring grad, where the op has a backward: it runs and is traced too (an activated
        # vit_triton::linear has none: autograd records vit_triton::linear_pre instead)
        if op in TRAINED and not (op is ops._linear and args[3] != "none"):
            args = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
            utils += ("test_autograd_registration", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, args, test_utils=utils)


def test_eager_calls_skip_the_dispatcher_and_agree_with_it():
    x, w, b = _r(13, 32), _r(24, 32), _r(24)
    direct = ops.linear(x, w, b, activation="gelu")
    torch.testing.assert_close(direct, torch.ops.vit_triton.linear(x, w, b, "gelu", None, 1.0, False, False), rtol=0,
                               atol=0)


def test_a_layer_with_an_activation_is_never_split(monkeypatch):
    # Split K leaves the product's sum to the next norm; an activation must see the whole sum first.
    monkeypatch.setattr(ops, "split_k", lambda *shape: 2)
    x, h = _r(5, 32, dtype=F32), _r(5, 48, dtype=F32)
    for act in ("gelu", "swiglu"):
        fc = randomize_(Linear(48, 32, activation=act, device=DEVICE))
        with torch.no_grad():
            assert torch.equal(ops.ResidualStream(x, batch=1).add(fc, h).tensor(), fc(h, residual=x))
    proj = randomize_(Linear(48, 32, device=DEVICE))
    with torch.no_grad(), pytest.raises(RuntimeError, match="pending split-K update"):
        ops.ResidualStream(x, batch=1).add(proj, h).tensor()   # without one, it is split


def test_torch_compile_traces_a_rotating_qkv_projection():
    x, w, b = _r(42, 48), _r(192, 48), _r(192)
    cos, sin = _rope(16, 32)

    def project(x, w, b, cos, sin):
        return ops.linear(x, w, b, rope=(cos, sin), rope_half=True, rope_prefix=5)

    compiled = torch.compile(project, fullgraph=True)   # a graph break would raise
    torch.testing.assert_close(compiled(x, w, b, cos, sin), project(x, w, b, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [
    dict(num_classes=7),
    dict(pool="avg", fc_norm=True, reg_tokens=2, num_classes=0, act="quick_gelu", pre_norm=True),
])
def test_torch_compile_traces_the_whole_model(cfg):
    model = randomize_(ViT(ViTConfig(image_size=24, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_dim=96,
                                     **cfg), device=DEVICE)).to(DT).eval()
    compiled = torch.compile(model, fullgraph=True)   # a graph break would raise
    with torch.inference_mode():
        for batch in (2, 3):   # the second batch size recompiles with a symbolic batch
            pixels = _r(batch, 3, 24, 24)
            torch.testing.assert_close(compiled(pixels), model(pixels), rtol=0, atol=0)


def test_torch_compile_at_another_image_size():
    # Traced, the position table is resampled inside the compiled graph (no Python cache to consult).
    model = randomize_(ViT(ViTConfig(image_size=24, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=96,
                                     num_classes=7), device=DEVICE)).to(DT).eval()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        pixels = _r(2, 3, 16, 40)
        torch.testing.assert_close(compiled(pixels), model(pixels), rtol=0, atol=0)
