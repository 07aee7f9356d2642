"""token_mean against Tensor.mean over the token axis, token_mean_backward against its torch autograd gradient."""

import itertools

import pytest
import torch

from tests.kernels.checks import (
    assert_written_in_place, check, check_grads, each_dtype, empty, nan_filled, rand, raises_value_error,
)
from tests.numerics import DEVICE
from vit_triton.kernels import token_mean, token_mean_backward
from vit_triton.kernels.common import sm_count
from vit_triton.kernels.token_mean import column_block


def torch_token_mean(start):
    return lambda x: x[:, start:].mean(1)


def average(x, start):
    check(token_mean(x, start), torch_token_mean(start), x)


STARTS = [0, 1, 5]                              # all tokens; after the class token; after class + 4 registers
TOKENS = [7, 37, 197]
DIMS = [301, 777, 45]                           # two column blocks of 256 and more, and one partial block


@each_dtype
@pytest.mark.parametrize("start, tokens", list(itertools.product(STARTS, TOKENS)))
def test_shapes(dtype, start, tokens):
    batch, dim = 1 + 2 * (start % 2), DIMS[(STARTS.index(start) + TOKENS.index(tokens)) % len(DIMS)]
    average(rand(batch, tokens, dim, dtype=dtype), start)


def test_a_small_batch_takes_narrow_columns():
    # Too few programs of 256 columns to fill the SMs: 64 columns each, so one image's mean spreads over more SMs.
    sms = sm_count(DEVICE)
    assert column_block(1, 768, DEVICE) == (64 if 3 < sms else 256)
    assert column_block(sms, 768, DEVICE) == 256
    assert column_block(1, 48, DEVICE) == 64 and column_block(sms, 48, DEVICE) == 64


@each_dtype
def test_one_token(dtype):
    average(rand(3, 1, 301, dtype=dtype), 0)


@each_dtype
@pytest.mark.parametrize("layout", ["token-pairs", "wide-rows"])
def test_strided_input(dtype, layout):
    # Tokens further apart than D: every other token of a tensor, or rows with columns past D.
    x = rand(3, 37, 2, 301, dtype=dtype)[:, :, 1] if layout == "token-pairs" else rand(3, 37, 310, dtype=dtype)[..., :301]
    average(x, 1)


@each_dtype
def test_every_element_is_written_in_place(dtype):
    x = rand(3, 37, 301, dtype=dtype)
    buffer = nan_filled(3, 305, dtype=dtype)
    out = buffer[:, 2:303]
    result = token_mean(x, 5, out=out)
    assert_written_in_place(result, out, buffer)
    check(result, torch_token_mean(5), x)


@pytest.mark.parametrize("change, message", [
    (dict(x=empty(7, 8)), "x must be 3-D [B, T, D] with unit stride along D, got shape (7, 8)"),
    (dict(x=empty(2, 8, 7).transpose(1, 2)), "x must be 3-D [B, T, D] with unit stride along D, got shape (2, 7, 8) "
                                             "and strides (56, 1, 7)"),
    (dict(x=empty(2, 7, 8).int()), "x must be float32, float16 or bfloat16, got torch.int32"),
    (dict(start=7), "start must be in [0, 7), got 7"),
    (dict(start=-1), "start must be in [0, 7), got -1"),
    (dict(out=empty(2, 7)), "out must be a torch.float32 tensor of shape (2, 8) with unit stride along D"),
    (dict(out=empty(2, 8, dtype=torch.float16)), "out must be a torch.float32 tensor of shape (2, 8)"),
    (dict(out=empty(8, 2).t()), "out must be a torch.float32 tensor of shape (2, 8) with unit stride along D"),
])
def test_bad_input(change, message):
    args = dict(x=empty(2, 7, 8), start=0, out=None) | change
    with raises_value_error(message):
        token_mean(args["x"], args["start"], out=args["out"])


@each_dtype
@pytest.mark.parametrize("batch, start, tokens, dim", [(1, 0, 7, 301), (3, 1, 37, 45), (2, 5, 197, 80)],
                         ids=["B1-from0-T7-D301", "B3-from1-T37-D45", "B2-from5-T197-D80"])
def test_backward(dtype, batch, start, tokens, dim):
    # start 0: every token's gradient dy / T; start > 0: the prefix tokens' gradient 0.
    x, dy = rand(batch, tokens, dim, dtype=dtype), rand(batch, dim, dtype=dtype)
    dx = token_mean_backward(dy, tokens, start)
    assert dx.is_contiguous()
    check_grads((dx,), torch_token_mean(start), dy, x)


def test_backward_every_element_is_written_in_place():
    dy = rand(3, 301, dtype=torch.bfloat16)
    buffer = nan_filled(3, 40, 305, dtype=torch.bfloat16)
    out = buffer[:, 1:38, 2:303]
    result = token_mean_backward(dy, 37, 5, dx=out)
    assert_written_in_place(result, out, buffer)
    torch.testing.assert_close(result, token_mean_backward(dy, 37, 5), rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(dy=empty(2, 7, 8)), "dy must be 2-D [B, D] with unit stride along D, got shape (2, 7, 8)"),
    (dict(dy=empty(8, 2).t()), "dy must be 2-D [B, D] with unit stride along D, got shape (2, 8) and strides (1, 2)"),
    (dict(dy=empty(2, 8).int()), "dy must be float32, float16 or bfloat16, got torch.int32"),
    (dict(start=7), "start must be in [0, 7), got 7"),
    (dict(dx=empty(2, 7, 9)), "dx must be a torch.float32 tensor of shape (2, 7, 8) with unit stride along D"),
    (dict(dx=empty(2, 7, 8, dtype=torch.bfloat16)), "dx must be a torch.float32 tensor of shape (2, 7, 8)"),
    (dict(dx=empty(2, 8, 7).transpose(1, 2)), "dx must be a torch.float32 tensor of shape (2, 7, 8) with unit"),
])
def test_backward_bad_input(change, message):
    args = dict(dy=empty(2, 8), start=0, dx=None) | change
    with raises_value_error(message):
        token_mean_backward(args["dy"], 7, args["start"], dx=args["dx"])
