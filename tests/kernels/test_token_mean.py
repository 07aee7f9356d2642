"""token_mean against Tensor.mean over the token axis."""

import pytest
import torch

from tests.numerics import DEVICE, DTYPES, assert_matches_torch
from vit_triton.kernels import token_mean


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, tokens, dim, start", [(1, 1, 16, 0), (3, 37, 300, 1), (2, 197, 768, 5),
                                                       (1, 50, 96, 49)])
def test_shapes(dtype, batch, tokens, dim, start):
    torch.manual_seed(tokens + dim)
    x = torch.randn(batch, tokens, dim, device=DEVICE).to(dtype)
    assert_matches_torch(lambda x: token_mean(x, start), lambda x: x[:, start:].mean(1), x)


def test_strided_input_and_every_element_written():
    x = torch.randn(3, 20, 2, 70, device=DEVICE)[:, :, 1]     # token stride 140, unit stride along D
    out = torch.full((3, 70), float("nan"), device=DEVICE)
    token_mean(x, 2, out=out)
    torch.testing.assert_close(out, x[:, 2:].mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda x: token_mean(x[0]), r"x must be 3-D \[B, T, D\]"),
    (lambda x: token_mean(x, 7), r"start must be in \[0, 7\), got 7"),
    (lambda x: token_mean(x, out=torch.empty(2, 5, device=DEVICE)), r"shape \(2, 8\)"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(2, 7, 8, device=DEVICE))
