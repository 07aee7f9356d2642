"""round_to_tf32: float32 rounded to tf32 (10 mantissa bits, to nearest, ties away from zero); the kernels'
tf32_input and tf32_output flags."""

import contextlib
import gc
import weakref

import pytest
import torch

from tests.kernels.checks import TF32_WEIGHT_PATHS, empty, inference, raises_value_error, rand, tf32_matmuls
from tests.numerics import DEVICE
from vit_triton.kernels import (
    add_layer_norm, fused_attention, launch_options, layer_norm, linear, linear_partials, round_to_tf32,
)
from vit_triton.kernels import tf32 as TF32
from vit_triton.kernels.tf32 import TF32_WEIGHT_ROWS

F32 = torch.float32

ULP = 2.0 ** -10   # tf32's spacing on [1, 2)


def specials() -> torch.Tensor:
    """Ties and near-ties on either side of zero, zeros and two denormals."""
    one = [1.0 + ULP / 2, 1.0 + ULP / 2 - 2.0 ** -23, 1.0 + ULP + ULP / 2, 3.0 - 2.0 ** -22]
    return torch.tensor(one + [-v for v in one] + [0.0, -0.0, 1e-40, -3e-39], device=DEVICE)


def nearest_tf32(t: torch.Tensor) -> torch.Tensor:
    """The tf32 value nearest to each finite element (below float32's largest), ties away from zero:
    from the two tf32 neighbours of |t| in float64, not from the bits. Denormals keep 10 bits of
    their mantissa field, as normal numbers do: a spacing of 2^-136."""
    t = t.double()
    mag = t.abs()
    exponent = torch.floor(torch.log2(torch.where(mag > 0, mag, 1.0))).clamp(min=-126)
    step = torch.exp2(exponent - 10)   # spacing of tf32 numbers around |t|
    below = torch.floor(mag / step) * step
    above = below + step
    nearest = torch.where(mag - below < above - mag, below, above)   # a tie goes up: away from zero
    return torch.where(mag > 0, torch.sign(t) * nearest, t)


def test_rounds_to_the_nearest_tf32_ties_away_from_zero():
    t = torch.cat([torch.randn(5000, device=DEVICE) * 10.0 ** torch.randint(-20, 20, (5000,), device=DEVICE),
                   specials()])
    out = round_to_tf32(t)
    assert torch.equal(out.double(), nearest_tf32(t)), (t, out)
    assert torch.equal(out.view(torch.int32) & 0x1FFF, torch.zeros_like(out, dtype=torch.int32))  # bits tf32 drops
    assert torch.equal(torch.signbit(out), torch.signbit(t))   # -0.0 stays -0.0


def test_overflow_and_non_finite_values():
    big = torch.finfo(torch.float32).max
    out = round_to_tf32(torch.tensor([big, -big, float("inf"), float("-inf"), float("nan")], device=DEVICE))
    assert out[:4].tolist() == [float("inf"), float("-inf"), float("inf"), float("-inf")]
    # NaNs stay NaN: PyTorch's, the GPU's canonical one (all ones: adding half a tf32 ulp to its bits
    # would carry into the sign and give -0.0), its negative and two whose payloads lie only in the bits
    # tf32 drops (the same carry would give infinities).
    nans = torch.tensor([0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001, -0x007FF001], dtype=torch.int32,
                        device=DEVICE).view(torch.float32)
    assert out[4].isnan() and round_to_tf32(nans).isnan().all(), round_to_tf32(nans)


def test_any_layout():
    t = torch.randn(37, 29, device=DEVICE).t()
    out = round_to_tf32(t)
    assert out.is_contiguous() and torch.equal(out, round_to_tf32(t.contiguous()))


def test_empty():
    assert round_to_tf32(empty(0, 3)).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_bad_dtype(dtype):
    with raises_value_error(f"t must be torch.float32, got {dtype}"):
        round_to_tf32(empty(4, dtype=dtype))


def test_out():
    t = torch.randn(5, 7, device=DEVICE)
    out = torch.full_like(t, float("nan"))
    assert round_to_tf32(t, out=out) is out and torch.equal(out, round_to_tf32(t))


@pytest.mark.parametrize("out, got", [
    (empty(7, 5), "torch.float32 (7, 5) on"),
    (empty(5, 7, dtype=torch.float64), "torch.float64 (5, 7) on"),
    (empty(7, 5).t(), "torch.float32 (5, 7) on"),   # not contiguous
])
def test_bad_out(out, got):
    t = empty(5, 7)
    with raises_value_error(f"out must be a contiguous torch.float32 tensor of shape (5, 7) on {t.device}, "
                            f"got {got} {t.device}"):
        round_to_tf32(t, out=out)


# The rounded copy of a weight that tf32 GEMMs keep (tf32.py): made once, rounded again in place when
# the weight changes through its version counter, gone with the weight.
def kept(w):
    return TF32._copies[id(w)].rounded


def test_the_copy_is_made_once_and_kept(monkeypatch):
    x, w = rand(3, 40, dtype=F32), rand(24, 40, dtype=F32)
    with tf32_matmuls():
        first = linear(x, w)
        copy = kept(w)
        assert torch.equal(copy, rounded(w))
        roundings = []
        monkeypatch.setattr(TF32, "round_to_tf32", lambda *a, **k: roundings.append(a))
        assert torch.equal(linear(x, w), first) and kept(w) is copy and not roundings


@pytest.mark.parametrize("change", ["add_", "copy_", "optimizer step", "load_state_dict"])
def test_the_copy_follows_in_place_changes(change):
    x = rand(3, 40, dtype=F32)
    layer = torch.nn.Linear(40, 24, device=DEVICE)
    w = layer.weight
    with tf32_matmuls():
        linear(x, w, layer.bias)
        address = kept(w).data_ptr()
        if change == "optimizer step":
            layer(x).square().sum().backward()
            torch.optim.SGD(layer.parameters(), lr=1.0).step()
        elif change == "load_state_dict":
            layer.load_state_dict(torch.nn.Linear(40, 24, device=DEVICE).state_dict())
        else:
            with torch.no_grad():
                getattr(w, change)(torch.randn_like(w))
        out = linear(x, w, layer.bias)
        assert torch.equal(out, linear(x, inference(w), layer.bias))   # no copy kept: rounded in the kernel
        assert torch.equal(kept(w), rounded(w)) and kept(w).data_ptr() == address   # same memory: graphs stay right


def test_refresh_copies_rounds_stale_copies_in_place():
    w = rand(24, 40, dtype=F32)
    with tf32_matmuls():
        linear(rand(3, 40, dtype=F32), w)
    address = kept(w).data_ptr()
    with torch.no_grad():
        w.mul_(3.0)
    assert not torch.equal(kept(w), rounded(w))
    TF32.refresh_copies()
    assert torch.equal(kept(w), rounded(w)) and kept(w).data_ptr() == address


def test_copies_leave_with_their_weights_and_clear_copies_drops_them():
    w = rand(24, 40, dtype=F32)
    with tf32_matmuls():
        linear(rand(3, 40, dtype=F32), w)
        assert id(w) in TF32._copies
        ref = weakref.ref(kept(w))
        del w
        gc.collect()
        assert ref() is None
        x, w = rand(3, 40, dtype=F32), rand(24, 40, dtype=F32)
        linear(x, w)
        w.data.copy_(rand(24, 40, dtype=F32))   # behind the version counter: the copy cannot see it
        TF32.clear_copies()
        assert id(w) not in TF32._copies
        assert torch.equal(linear(x, w), linear(x, inference(w))) and torch.equal(kept(w), rounded(w))


def test_no_copy_without_tf32_or_of_an_inference_tensor():
    x, w = rand(3, 40, dtype=F32), rand(24, 40, dtype=F32)
    linear(x, w, allow_tf32=False)
    assert id(w) not in TF32._copies
    with tf32_matmuls():
        frozen = inference(w)
        linear(x, frozen)
        assert id(frozen) not in TF32._copies


def test_no_copies_kept_when_turned_off(one_config):
    # launch_options(tf32_copies=False) trades the copies' memory for speed: the GEMM rounds W for the
    # call (from TF32_WEIGHT_ROWS rows) or in its K loop, with the same bits.
    w = rand(24, 40, dtype=F32)
    with tf32_matmuls():
        small, large = (rand(rows, 40, dtype=F32) for rows in (3, TF32.TF32_WEIGHT_ROWS))
        expected = [linear(x, w) for x in (small, large)]
        TF32.clear_copies()
        with launch_options(tf32_copies=False):
            assert [torch.equal(linear(x, w), e) for x, e in zip((small, large), expected)] == [True, True]
        assert id(w) not in TF32._copies


# The tf32_output / tf32_input flags of the kernels that write and read matmul operands: a flagged
# output is the unflagged one rounded (round_to_tf32), a flagged input skips a rounding that changes
# nothing, and with tf32 off (or in 16-bit) the flags change nothing. One launch config for each
# kernel (one_config), so that only the flags differ.
def rounded(t):
    return round_to_tf32(t).view(t.shape)


@pytest.mark.parametrize("act, rows", [("gelu", 45), ("swiglu", 90)])   # swiglu: y 45 wide too
@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
def test_linear_flags(one_config, tf32, act, rows):
    x, w, b = rand(70, 53, dtype=F32), rand(rows, 53, dtype=F32), rand(rows, dtype=F32)
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        plain = linear(x, w, b, activation=act)
        out = linear(x, w, b, activation=act, tf32_output=True)
        assert torch.equal(out, rounded(plain) if tf32 else plain)
        assert torch.equal(linear(rounded(x), w, b, activation=act, tf32_input=True),
                           linear(rounded(x), w, b, activation=act))
        parts = linear_partials(rounded(x), w, b, 2, tf32_input=True)
        assert torch.equal(parts, linear_partials(rounded(x), w, b, 2))


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
def test_attention_flags(one_config, tf32):
    q, k, v = rand(2, 37, 3, 3, 16, dtype=F32).unbind(2)
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        plain = fused_attention(q, k, v)
        assert torch.equal(fused_attention(q, k, v, tf32_output=True), rounded(plain) if tf32 else plain)
        q, k, v = (rounded(t) for t in (q, k, v))
        assert torch.equal(fused_attention(q, k, v, tf32_input=True), fused_attention(q, k, v))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms-no-bias"])
@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
@pytest.mark.parametrize("rows, width", [(4099, 64), (343, 768)])
def test_layer_norm_flags(tf32, rows, width, rms):
    # About 2.6e5 values: on an H100 two builds of the kernel once fused different squares of the variance
    # into FMAs, and one rounded value in about 10^5 came out a tf32 step off.
    x, w = rand(rows, width, dtype=F32, scale=3.0, shift=1.0), rand(width, dtype=F32)
    b = None if rms else rand(width, dtype=F32)
    parts = rand(2, rows, width, dtype=F32)
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        plain = layer_norm(x, w, b, 1e-6, rms=rms)
        assert torch.equal(layer_norm(x, w, b, 1e-6, rms=rms, tf32_output=True), rounded(plain) if tf32 else plain)
        total, normed = add_layer_norm(x, parts, w, b, 1e-6, rms=rms)
        flagged_total, flagged = add_layer_norm(x, parts, w, b, 1e-6, rms=rms, tf32_output=True)
        assert torch.equal(flagged_total, total)   # the residual stream itself is never rounded
        assert torch.equal(flagged, rounded(normed) if tf32 else normed)


@TF32_WEIGHT_PATHS
def test_nan_operands_give_nan_not_zero(large, inference_weight):
    # The GPU's own NaN (bits all ones) rounded on the bits alone would become -0.0 and vanish from the
    # product; in x, in W, or written by a producer, it must reach the output.
    x, w = rand(TF32_WEIGHT_ROWS if large else 3, 40, dtype=F32), rand(24, 40, dtype=F32)
    x.view(torch.int32)[1, 5] = 0x7FFFFFFF
    w.view(torch.int32)[7, 3] = 0x7FFFFFFF
    w = inference(w) if inference_weight else w
    with tf32_matmuls():
        out = linear(x, w, tf32_output=True)
        assert out[1].isnan().all() and out[:, 7].isnan().all()
        assert not out[0, :7].isnan().any()
        assert linear(out, rand(5, 24, dtype=F32), tf32_input=True)[1].isnan().all()


def test_flags_change_nothing_in_16_bit(one_config):
    x, w = rand(33, 40, dtype=torch.bfloat16), rand(24, 40, dtype=torch.bfloat16)
    ln_w, ln_b = rand(40, dtype=torch.bfloat16), rand(40, dtype=torch.bfloat16)
    q, k, v = rand(1, 19, 3, 2, 16, dtype=torch.bfloat16).unbind(2)
    with tf32_matmuls():
        assert torch.equal(linear(x, w, tf32_input=True, tf32_output=True), linear(x, w))
        assert torch.equal(layer_norm(x, ln_w, ln_b, 1e-6, tf32_output=True), layer_norm(x, ln_w, ln_b, 1e-6))
        assert torch.equal(fused_attention(q, k, v, tf32_input=True, tf32_output=True), fused_attention(q, k, v))
