"""A vit-triton model trains as its PyTorch reference does: the gradient of every parameter and of the pixels,
over config variants that take every op's backward, against model/reference.py in float64 (autograd through
PyTorch's operators) and in 16 bits against PyTorch's own error; model.train()'s stochastic depth, dropout and
activation checkpointing; frozen parameters; autocast; torch.compile of a whole training step."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.numerics import DEVICE, assert_close, randomize_
from vit_triton import kernels, ops
from vit_triton.model import ViT, ViTConfig, vit
from vit_triton.model.reference import reference_forward

SMALL = dict(image_size=24, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=48)

# Each variant takes a path of some op's backward: pooling (class token, mean, attention pool, DeiT's two heads),
# LayerScale, the activations, SwiGLU with EVA02's sub-norm, RMSNorm, each rotary kind, registers, pre-norm,
# AIMv2's normalised patch embeddings with a sin-cos table, a projection.
VARIANTS = {
    "cls-head-layer_scale": dict(num_classes=7, layer_scale=True),
    "avg-fc_norm-registers-no_embed_class": dict(pool="avg", fc_norm=True, reg_tokens=2, num_classes=5,
                                                 act="gelu_tanh", pos_embed_prefix=False),
    "clip-pre_norm-projection": dict(pre_norm=True, patch_bias=False, act="quick_gelu", proj_dim=24),
    "eva02-swiglu-mlp_norm-rope-axial": dict(act="swiglu", mlp_norm=True, rope="axial", pool="avg", fc_norm=True,
                                             num_classes=5, layer_scale=True),
    "dinov3-rope-centered-half-registers": dict(rope="centered", rope_theta=100.0, rope_half=True,
                                                abs_pos_embed=False, reg_tokens=2, layer_scale=True),
    "rope-mixed-learned-freqs": dict(rope="mixed", rope_theta=10.0, num_classes=5),
    "siglip-map": dict(class_token=False, pool="map", act="gelu_tanh"),
    "aimv2-embed_norm-sincos-map-no-q": dict(norm="rmsnorm", act="swiglu", qkv_bias=False, proj_bias=False,
                                             mlp_bias=False, class_token=False, embed_norm=True, pos_sincos=True,
                                             pool="map", pool_query_proj=False, pool_mlp=False),
    "deit-distilled": dict(dist_token=True, head_dist=True, num_classes=5),
}


def make(variant: str, dtype=torch.float32, **extra) -> ViT:
    cfg = ViTConfig(**{**SMALL, **VARIANTS[variant], **extra})
    model = randomize_(ViT(cfg, device=DEVICE))
    if cfg.rope == "mixed":   # learned frequencies, not timm's zeros
        with torch.no_grad():
            model.rope_freqs.uniform_(0.0, 1.0)
    return model.to(dtype)


def loss_of(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient with respect to out is `weights` (random, so that every output element counts)."""
    return (out.float() * weights).sum()


def grads(model: ViT, pixels: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of loss_of(model(pixels)) for every parameter and for the pixels ("pixels")."""
    model.zero_grad(set_to_none=True)
    pixels = pixels.detach().requires_grad_()
    loss_of(model(pixels), weights).backward()
    out = {name: p.grad for name, p in model.named_parameters()}
    out["pixels"] = pixels.grad
    return out


def reference_grads(model: ViT, pixels: torch.Tensor, weights: torch.Tensor, dtype=torch.float64,
                    device=torch.device("cpu"), branch_scales=None) -> dict[str, torch.Tensor]:
    """The same gradients from reference_forward, on copies of the parameters and pixels in dtype on device."""
    params = {name: p.detach().to(device, dtype).requires_grad_() for name, p in model.named_parameters()}
    x = pixels.detach().to(device, dtype).requires_grad_()
    scales = None if branch_scales is None else [tuple(s.to(device) for s in pair) for pair in branch_scales]
    loss_of(reference_forward(model.config, params, x, branch_scales=scales), weights.to(device)).backward()
    out = {name: p.grad for name, p in params.items()}
    out["pixels"] = x.grad
    return out


def assert_grads_close(got, ref, dtype, torch_low=None):
    """Each gradient within the tolerance rule of its float64 reference; in 16 bits (torch_low: PyTorch's own 16-bit
    gradients) the parameters' gradients as one vector, the pixels' apart: over a tensor of a few dozen values a
    16-bit error swings past 1.5x PyTorch's by chance (each kernel's gradients meet the rule tensor by tensor in
    tests/kernels)."""
    assert got.keys() == ref.keys()
    assert all(got[name] is not None for name in ref), [name for name in ref if got[name] is None]
    if torch_low is not None:
        def flat(grads):
            return [torch.cat([g.flatten().to(ref["pixels"]) for name, g in grads.items() if name != "pixels"]),
                    grads["pixels"].to(ref["pixels"])]
        got, ref, torch_low = ({"parameters": f, "pixels": p} for f, p in (flat(got), flat(ref), flat(torch_low)))
    for name in ref:
        try:
            assert_close(got[name], ref[name], dtype, None if torch_low is None else torch_low[name])
        except AssertionError as e:
            raise AssertionError(f"gradient of {name}: {e}") from None


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_gradient_float32(variant):
    model = make(variant)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, model.config.proj_dim or model.config.num_classes or model.config.embed_dim,
                          device=DEVICE)
    assert_grads_close(grads(model, pixels, weights), reference_grads(model, pixels, weights), torch.float32)


def test_gradients_at_another_image_size():
    # 20 x 36 pixels: a 2 x 4 patch grid where the table is 3 x 3, resampled (bicubic) under autograd.
    model = make("cls-head-layer_scale")
    pixels = torch.randn(3, 3, 20, 36, device=DEVICE)
    weights = torch.randn(3, 7, device=DEVICE)
    assert_grads_close(grads(model, pixels, weights), reference_grads(model, pixels, weights), torch.float32)


@pytest.mark.parametrize("variant", ["cls-head-layer_scale", "eva02-swiglu-mlp_norm-rope-axial", "siglip-map"])
def test_every_gradient_bfloat16(variant):
    # Within 1.5x the error of PyTorch's own bf16 autograd through the reference, both against float64.
    model = make(variant, torch.bfloat16)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, model.config.num_classes or model.config.embed_dim, device=DEVICE)
    assert_grads_close(grads(model, pixels, weights), reference_grads(model, pixels, weights), torch.bfloat16,
                       reference_grads(model, pixels, weights, torch.bfloat16, DEVICE))


def test_stochastic_depth_drops_each_branch_per_image_as_timm_draws_it(monkeypatch):
    model = make("cls-head-layer_scale", drop_path_rate=0.5).train()
    assert [b.drop_path for b in model.blocks] == [0.0, 0.5]   # timm's ramp
    drawn = []
    draw = vit.Block._drop_path

    def recording(self, batch, tokens, device):
        scale = draw(self, batch, tokens, device)
        drawn.append(torch.ones(batch, device=device) if scale is None else scale[::tokens])
        return scale

    monkeypatch.setattr(vit.Block, "_drop_path", recording)
    torch.manual_seed(3)   # 4 images: some dropped, some kept, in the second block
    pixels = torch.randn(4, 3, 24, 24, device=DEVICE)
    weights = torch.randn(4, 7, device=DEVICE)
    got = grads(model, pixels, weights)
    scales = list(zip(drawn[0::2], drawn[1::2]))
    assert set(torch.cat(drawn[2:]).tolist()) <= {0.0, 2.0} and 0.0 in torch.cat(drawn[2:]).tolist()
    assert_grads_close(got, reference_grads(model, pixels, weights, branch_scales=scales), torch.float32)
    model.eval()   # no drop: the reference without scales
    torch.testing.assert_close(model(pixels), reference_forward(model.config, dict(model.named_parameters()), pixels),
                               rtol=1e-5, atol=1e-5)


def test_dropout_of_the_tokens_and_the_pooled_features_in_training_only():
    model = make("cls-head-layer_scale", pos_drop_rate=0.5, drop_rate=0.5)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(model.eval()(pixels), model(pixels))
        model.train()
        assert not torch.equal(model(pixels), model(pixels))


def test_activation_checkpointing_gives_the_same_gradients():
    model = make("eva02-swiglu-mlp_norm-rope-axial", drop_path_rate=0.3).train()
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, 5, device=DEVICE)
    torch.manual_seed(0)
    plain = grads(model, pixels, weights)
    model.set_grad_checkpointing()
    torch.manual_seed(0)
    checkpointed = grads(model, pixels, weights)
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


def test_a_frozen_backbone_gets_no_gradient_and_no_weight_products(monkeypatch):
    model = make("cls-head-layer_scale")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    asked = []
    backward = kernels.linear_backward

    def recording(*args, **kw):
        asked.append((kw["need_dx"], kw["need_dweight"]))
        return backward(*args, **kw)

    monkeypatch.setattr(kernels, "linear_backward", recording)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    loss_of(model(pixels), torch.randn(2, 7, device=DEVICE)).backward()
    assert asked == [(False, True)]   # the head's dW alone: nothing below it is differentiated
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_autocast_over_float32_weights_gives_float32_gradients():
    model = make("cls-head-layer_scale")
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, 7, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = grads(model, pixels, weights)
    assert all(g.dtype == torch.float32 for g in got.values())
    # bf16 activations throughout: within 1.5x the error of the pure-bf16 reference's gradients
    assert_grads_close(got, reference_grads(model, pixels, weights), torch.bfloat16,
                       reference_grads(model.to(torch.bfloat16), pixels, weights, torch.bfloat16, DEVICE))


def test_torch_compile_traces_forward_and_backward_without_graph_breaks():
    model = make("eva02-swiglu-mlp_norm-rope-axial")
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, 5, device=DEVICE)
    eager = grads(model, pixels, weights)
    model.zero_grad(set_to_none=True)
    loss_of(torch.compile(model, fullgraph=True)(pixels), weights).backward()   # a graph break would raise
    # The same kernels; inductor may sum the PyTorch code's gradients around them (the pooled view's, the position
    # table's) in another order, so within float32's rounding rather than bit for bit.
    for name, p in model.named_parameters():
        assert_close(p.grad, eager[name].double(), torch.float32)


class _OpNames(TorchDispatchMode):
    """The names of the operators dispatched while it is on (the custom ops' too)."""

    def __init__(self) -> None:
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["cls-head-layer_scale", "eva02-swiglu-mlp_norm-rope-axial", "siglip-map"])
def test_eager_training_skips_the_dispatcher_and_agrees_with_the_ops_bit_for_bit(variant, monkeypatch):
    # Eager, the recorded calls run their autograd.Function and the backward kernels' functions; through the custom
    # ops (what torch.compile traces) the same kernels give the same bits, outputs and gradients alike.
    model = make(variant, torch.bfloat16)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, model.config.num_classes or model.config.embed_dim, device=DEVICE)
    results = []
    for via_ops in (False, True):
        if via_ops:
            monkeypatch.setattr(ops, "_apply", lambda op, *args: op(*args))
        with _OpNames() as seen:
            results.append((model(pixels), grads(model, pixels, weights)))
        assert any(name.startswith("vit_triton::") for name in seen.names) == via_ops, sorted(seen.names)
    (eager_out, eager), (op_out, via_op) = results
    assert torch.equal(eager_out, op_out)
    for name in eager:
        assert torch.equal(eager[name], via_op[name]), name


def test_inference_calls_skip_the_dispatcher(monkeypatch):
    # Without autograd, autocast or tracing, the model's calls go straight to the launchers.
    model = make("cls-head-layer_scale")
    monkeypatch.setattr(ops, "_linear", None)
    with torch.no_grad():
        model(torch.randn(1, 3, 24, 24, device=DEVICE))
