"""layer_norm and add_layer_norm (a split GEMM's partial sums added first) against F.layer_norm, and as RMSNorm
against F.rms_norm, each with and without bias; layer_norm with a table added after the norm (post_add); its
statistics for the backward, and layer_norm_backward against torch autograd."""

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.checks import (
    assert_written_in_place, check, check_grads, each_dtype, empty, nan_filled, rand, raises_value_error,
)
from tests.numerics import assert_close
from vit_triton.kernels import add_layer_norm, layer_norm, layer_norm_backward

LAYER_NORM = importlib.import_module("vit_triton.kernels.layer_norm")   # the module; the package exports functions


def torch_layer_norm(eps):
    return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps)


def torch_rms_norm(eps):
    """F.rms_norm, then the bias if there is one (RMSNorm has none in PyTorch)."""
    return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps) + (0 if b is None else b)


def inputs(m, d, dtype, row_stride=None):
    """x [m, d] with a mean offset and a scale (x*3 + 5: a one-pass E[x^2] - E[x]^2 variance would
    lose digits), rows row_stride apart when given; weight and bias random, not 1 and 0."""
    x = rand(m, row_stride or d, dtype=dtype, scale=3.0, shift=5.0)[:, :d]
    return x, rand(d, dtype=dtype, scale=0.5, shift=1.0), rand(d, dtype=dtype)


def normalize(x, w, b, eps):
    check(layer_norm(x, w, b, eps), torch_layer_norm(eps), x, w, b)


WIDTHS = [32, 80, 768, 1000]
EPSILONS = [1e-6, 1e-12, 1e-5]
ROWS = [1, 3, 37, 197]


@each_dtype
@pytest.mark.parametrize("d, eps", list(itertools.product(WIDTHS, EPSILONS)))
def test_shapes(dtype, d, eps):
    m = ROWS[(WIDTHS.index(d) + EPSILONS.index(eps)) % len(ROWS)]
    normalize(*inputs(m, d, dtype), eps)


@each_dtype
@pytest.mark.parametrize("m, d", [(3, 768), (37, 80), (197, 1000)])
def test_strided_rows(dtype, m, d):
    # The class tokens of a [B, T, D] tensor are rows T*D apart; here the rows lie d + 9 apart.
    normalize(*inputs(m, d, dtype, row_stride=d + 9), 1e-6)


@each_dtype
def test_every_element_is_written_in_place(dtype):
    x, w, b = inputs(67, 130, dtype)
    buffer = nan_filled(67, 133, dtype=dtype)
    out = buffer[:, 2:132]
    result = layer_norm(x, w, b, 1e-6, out=out)
    assert_written_in_place(result, out, buffer)
    check(result, torch_layer_norm(1e-6), x, w, b)


# The norms besides LayerNorm with bias: (rms, bias).
NORMS = pytest.mark.parametrize("rms, bias", [(False, False), (True, False), (True, True)],
                                ids=["layer-no-bias", "rms-no-bias", "rms-bias"])


def torch_norm(eps, rms):
    return torch_rms_norm(eps) if rms else torch_layer_norm(eps)


@each_dtype
@NORMS
@pytest.mark.parametrize("m, d, eps", [(1, 45, 1e-6), (37, 80, 1e-5), (197, 769, 1e-6), (5, 1000, 1e-12)])
def test_rms_and_bias_free(dtype, rms, bias, m, d, eps):
    # x*3 + 5 (inputs): a mean subtracted in RMSNorm would move every output; odd widths D = 45 and 769.
    x, w, b = inputs(m, d, dtype)
    b = b if bias else None
    check(layer_norm(x, w, b, eps, rms=rms), torch_norm(eps, rms), x, w, b)


@each_dtype
@pytest.mark.parametrize("rms, bias, m, rows, d", [(True, False, 45, 15, 45), (False, True, 74, 37, 769),
                                                  (True, True, 5, 1, 1000)], ids=["rms", "layer", "rms-bias-one-row"])
def test_post_add(dtype, rms, bias, m, rows, d):
    # A table of `rows` rows added after the norm to each group of `rows` rows of x (a position table per image).
    x, w, b = inputs(m, d, dtype)
    b = b if bias else None
    table = rand(rows, d, dtype=dtype)
    check(layer_norm(x, w, b, 1e-6, rms=rms, post_add=table),
          lambda x, w, b, t: torch_norm(1e-6, rms)(x, w, b) + t.repeat(m // rows, 1), x, w, b, table)


@pytest.mark.parametrize("post_add, message", [
    (empty(4, 12), "post_add must be [R, 12] with R dividing the 6 rows of x, got shape (4, 12)"),
    (empty(3, 11), "post_add must be [R, 12] with R dividing the 6 rows of x, got shape (3, 11)"),
    (empty(3, 12, dtype=torch.bfloat16), "post_add must be torch.float32, got torch.bfloat16"),
])
def test_post_add_bad_input(post_add, message):
    x, w, b = inputs(6, 12, torch.float32)
    with raises_value_error(message):
        layer_norm(x, w, b, 1e-6, post_add=post_add)


def add_then(fn):
    """fn of x + parts.sum(0), the sum rounded once to x's precision as add_layer_norm rounds it."""
    return lambda x, parts, *rest: fn((x + parts.sum(0)).to(x.dtype), *rest)


@each_dtype
@pytest.mark.parametrize("m, d, splits, row_stride", [(1, 32, 1, None), (37, 80, 2, 89), (197, 768, 3, None),
                                                      (5, 1000, 4, 1003)])
def test_add_layer_norm(dtype, m, d, splits, row_stride):
    # The residual stream x (with a mean offset; rows row_stride apart when given) plus the fp32
    # partial sums of a split GEMM.
    x, w, b = inputs(m, d, dtype, row_stride)
    parts = rand(splits, m, d, dtype=torch.float32)
    total, y = add_layer_norm(x, parts, w, b, 1e-6)
    check(total, add_then(lambda s: s), x, parts)
    check(y, add_then(torch_layer_norm(1e-6)), x, parts, w, b)


@each_dtype
@NORMS
@pytest.mark.parametrize("m, d, splits, row_stride", [(37, 45, 2, 51), (5, 769, 4, None)])
def test_add_rms_and_bias_free(dtype, rms, bias, m, d, splits, row_stride):
    x, w, b = inputs(m, d, dtype, row_stride)
    b = b if bias else None
    parts = rand(splits, m, d, dtype=torch.float32)
    total, y = add_layer_norm(x, parts, w, b, 1e-6, rms=rms)
    check(total, add_then(lambda s: s), x, parts)
    check(y, add_then(torch_norm(1e-6, rms)), x, parts, w, b)


@pytest.mark.parametrize("rms, bias", [(False, True), (True, False)], ids=["layer", "rms-no-bias"])
def test_add_layer_norm_normalises_the_rounded_sum(rms, bias):
    # y must be the norm of the stream as stored (what the next block adds to), bit for bit.
    x, w, b = inputs(37, 80, torch.bfloat16)
    b = b if bias else None
    total, y = add_layer_norm(x, rand(2, 37, 80, dtype=torch.float32), w, b, 1e-6, rms=rms)
    torch.testing.assert_close(y, layer_norm(total, w, b, 1e-6, rms=rms), rtol=0, atol=0)


@pytest.mark.parametrize("parts, message", [
    (empty(2, 5, 11), "parts must have shape [S, 5, 12], got (2, 5, 11)"),
    (empty(5, 12), "parts must have shape [S, 5, 12], got (5, 12)"),
    (empty(1, 5, 12, dtype=torch.bfloat16), "parts must be torch.float32, got torch.bfloat16"),
])
def test_add_layer_norm_bad_parts(parts, message):
    x, w, b = inputs(5, 12, torch.bfloat16)
    with raises_value_error(message):
        add_layer_norm(x, parts, w, b, 1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(w=empty(11)), "weight must have shape (12,), got (11,)"),
    (dict(b=empty(1, 12)), "bias must have shape (12,), got (1, 12)"),
    (dict(b=empty(12, dtype=torch.float16)), "bias must be torch.float32, got torch.float16"),
    (dict(x=empty(5, 12).int()), "x must be float32, float16 or bfloat16, got torch.int32"),
    (dict(x=empty(1, 5, 12)), "x must be 2-D [M, D] with unit stride along D, got shape (1, 5, 12)"),
    (dict(x=empty(12, 5).t()), "x must be 2-D [M, D] with unit stride along D, got shape (5, 12) and strides (1, 5)"),
    (dict(out=empty(5, 11)), "out must have shape (5, 12), got (5, 11)"),
    (dict(out=empty(5, 12, dtype=torch.bfloat16)), "out must be torch.float32, got torch.bfloat16"),
    (dict(out=empty(12, 5).t()), "out must have unit stride along D, got strides (1, 5)"),
])
def test_bad_input(change, message):
    args = dict(zip("xwb", inputs(5, 12, torch.float32)), out=None) | change
    with raises_value_error(message):
        layer_norm(args["x"], args["w"], args["b"], 1e-6, out=args["out"])


def forward_with_stats(x, w, b, eps, rms, post_add=None):
    """layer_norm's output and its statistics for the backward."""
    stats = torch.full((2, x.shape[0]), float("nan"), device=x.device)
    return layer_norm(x, w, b, eps, rms=rms, post_add=post_add, stats=stats), stats


@each_dtype
@NORMS
def test_stats(dtype, rms, bias):
    # The output obeys the rule as the one without stats does (not bit for bit: the two builds may contract the sum
    # of squares into FMAs in another order; on an H200 LayerNorm without bias differed in the last bit of half its
    # outputs); the stats are the row's mean (0 for RMSNorm) and 1 / sqrt(var + eps) (or of mean(x^2) + eps), in
    # float32 whatever x's dtype.
    x, w, b = inputs(37, 769, dtype, row_stride=777)
    b = b if bias else None
    y, stats = forward_with_stats(x, w, b, 1e-5, rms)
    check(y, (torch_rms_norm if rms else torch_layer_norm)(1e-5), x, w, b)
    x64 = x.double().cpu()
    mean = torch.zeros_like(x64[:, 0]) if rms else x64.mean(1)
    rstd = ((x64 - mean[:, None]).square().mean(1) + 1e-5).rsqrt()
    if rms:
        assert (stats[0] == 0).all()
    else:
        assert_close(stats[0], mean, torch.float32)
    assert_close(stats[1], rstd, torch.float32)


def backward(x, w, b, eps, rms, dy, **options):
    _, stats = forward_with_stats(x, w, b, eps, rms)
    return layer_norm_backward(dy, x, w, stats, rms=rms, has_bias=b is not None, **options)


@each_dtype
@pytest.mark.parametrize("rms, bias, m, d, row_stride", [
    (False, True, 1, 45, None), (False, True, 37, 769, 777), (True, False, 3, 80, None), (True, True, 37, 45, 51),
    (False, False, 3, 769, None),
], ids=["layer-1x45", "layer-strided-37x769", "rms-3x80", "rms-bias-strided-37x45", "layer-no-bias-3x769"])
def test_backward(dtype, rms, bias, m, d, row_stride):
    x, w, b = inputs(m, d, dtype, row_stride)
    b = b if bias else None
    dy = rand(m, row_stride or d, dtype=dtype)[:, :d]   # rows apart as x's, when x's are
    dx, dw, db, dpost = backward(x, w, b, 1e-6, rms, dy)
    assert dpost is None and (db is None) == (b is None)
    check_grads((dx, dw, db), torch_norm(1e-6, rms), dy, x, w, b)


@each_dtype
@pytest.mark.parametrize("rms, bias, m, rows, d", [(True, False, 45, 15, 45), (False, True, 74, 37, 769),
                                                  (True, True, 5, 1, 80)], ids=["rms", "layer", "rms-bias-one-row"])
def test_backward_post_add(dtype, rms, bias, m, rows, d):
    # The table's gradient: row r sums dy over the rows m with m % R == r (every image's patch r).
    x, w, b = inputs(m, d, dtype)
    b = b if bias else None
    table, dy = rand(rows, d, dtype=dtype), rand(m, d, dtype=dtype)
    _, stats = forward_with_stats(x, w, b, 1e-6, rms, post_add=table)
    grads = layer_norm_backward(dy, x, w, stats, rms=rms, has_bias=bias, post_add_rows=rows)
    check_grads(grads, lambda x, w, b, t: torch_norm(1e-6, rms)(x, w, b) + t.repeat(m // rows, 1), dy, x, w, b, table)


NEEDS = ("need_dx", "need_dweight", "need_dbias")


@pytest.mark.parametrize("post_add_rows", [0, 5])
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (False, True, True), (False, False, False)], ids=["dx", "dw", "db", "dw-db", "none"])
def test_backward_computes_only_what_is_needed(monkeypatch, needs, post_add_rows):
    # What is not needed is None and its work is compiled out (the kernel's flags and pointers); what is needed is
    # what the full call gives, bit for bit (the same programs sum the same rows: deterministic).
    x, w, b = inputs(35, 80, torch.bfloat16)
    dy = rand(35, 80, dtype=torch.bfloat16)
    full = backward(x, w, b, 1e-6, False, dy, post_add_rows=post_add_rows)
    launches = []
    kernel = LAYER_NORM._layer_norm_backward_kernel
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *args, **kwargs: launches.append((args, kwargs)) or run(*args, **kwargs))
    grads = backward(x, w, b, 1e-6, False, dy, post_add_rows=post_add_rows, **dict(zip(NEEDS, needs)))
    for needed, ours, whole in zip((*needs, post_add_rows > 0), grads, full):
        assert (ours is None) != needed
        if needed:
            torch.testing.assert_close(ours, whole, rtol=0, atol=0)
    if not any(needs) and not post_add_rows:
        assert not launches
        return
    [(args, kwargs)] = launches
    launch = dict(zip(kernel.arg_names, args)) | kwargs
    sum_dy = needs[2] or post_add_rows > 0   # the table's gradient sums dy too
    assert (launch["NEED_DX"], launch["NEED_DW"], launch["SUM_DY"], launch["PER_ROW"]) == (
        needs[0], needs[1], sum_dy, post_add_rows > 0)
    for flag, pointer in zip((needs[0], needs[1], sum_dy), ("dx_ptr", "dw_ptr", "dsum_ptr")):
        assert (launch[pointer] is None) != flag, pointer


@pytest.mark.parametrize("in_dy", [False, True], ids=["buffer", "over-dy"])
def test_backward_dx_in_place(in_dy):
    # dx into a strided view of a NaN-filled buffer (every element written, nothing outside), or over dy itself.
    x, w, b = inputs(37, 80, torch.float32)
    dy = rand(37, 80, dtype=torch.float32)
    expected, *_ = backward(x, w, b, 1e-6, False, dy)
    buffer = nan_filled(37, 83, dtype=torch.float32)
    out = dy if in_dy else buffer[:, 1:81]
    dx, *_ = backward(x, w, b, 1e-6, False, dy.clone() if not in_dy else dy, dx=out)
    if not in_dy:
        assert_written_in_place(dx, out, buffer)
    assert dx.data_ptr() == out.data_ptr()
    torch.testing.assert_close(dx, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change, message", [
    (dict(dy=empty(5, 11)), "dy must have shape (5, 12), got (5, 11)"),
    (dict(dy=empty(5, 12, dtype=torch.bfloat16)), "dy must be torch.float32, got torch.bfloat16"),
    (dict(dy=empty(12, 5).t()), "dy must have unit stride along D, got strides (1, 5)"),
    (dict(stats=empty(5, 2)), "stats must have shape (2, 5), got (5, 2)"),
    (dict(stats=empty(2, 5, dtype=torch.bfloat16)), "stats must be torch.float32, got torch.bfloat16"),
    (dict(stats=empty(5, 2).t()), "stats must be contiguous, got strides (1, 2)"),
    (dict(post_add_rows=2), "post_add_rows must be 0 or divide the 5 rows of x, got 2"),
    (dict(dx=empty(5, 12, dtype=torch.float16)), "dx must be torch.float32, got torch.float16"),
    (dict(dx=empty(12, 5).t()), "dx must have unit stride along D, got strides (1, 5)"),
])
def test_backward_bad_input(change, message):
    x, w, _ = inputs(5, 12, torch.float32)
    args = dict(dy=empty(5, 12), stats=empty(2, 5), post_add_rows=0, dx=None) | change
    with raises_value_error(message):
        layer_norm_backward(args["dy"], x, w, args["stats"], post_add_rows=args["post_add_rows"], dx=args["dx"])


def test_stats_bad_input():
    x, w, b = inputs(5, 12, torch.float32)
    with raises_value_error("stats must have shape (2, 5), got (2, 6)"):
        layer_norm(x, w, b, 1e-6, stats=empty(2, 6))
