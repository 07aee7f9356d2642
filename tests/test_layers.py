"""The model's parametrized layers in the forms a ViT forward does not take yet: Linear as a gated MLP's fc1
(swiglu), LayerNorm without bias and as RMSNorm, against PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.checks import check
from tests.numerics import DEVICE, randomize_
from vit_triton.model.layers import LayerNorm, Linear


def torch_swiglu(x, w, b):
    return F.silu(F.linear(x, w[0::2], b[0::2])) * F.linear(x, w[1::2], b[1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_swiglu_linear_holds_a_gate_and_a_value_row_for_each_output(dtype):
    fc1 = randomize_(Linear(48, 45, activation="swiglu", device=DEVICE)).to(dtype)
    assert fc1.weight.shape == (90, 48) and fc1.bias.shape == (90,)
    x = torch.randn(37, 48, device=DEVICE).to(dtype)
    with torch.no_grad():
        check(fc1(x), torch_swiglu, x, fc1.weight, fc1.bias)


def torch_norm(rms):
    if rms:
        return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6) + (0 if b is None else b)
    return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-6)


@pytest.mark.parametrize("rms, bias", [(False, False), (True, False), (True, True)],
                         ids=["layer-no-bias", "rms-no-bias", "rms-bias"])
def test_norms(rms, bias):
    norm = randomize_(LayerNorm(45, 1e-6, bias=bias, rms=rms, device=DEVICE))
    assert [name for name, _ in norm.named_parameters()] == (["weight", "bias"] if bias else ["weight"])
    x = torch.randn(37, 45, device=DEVICE) * 3 + 5
    with torch.no_grad():
        check(norm(x), torch_norm(rms), x, norm.weight, norm.bias)
