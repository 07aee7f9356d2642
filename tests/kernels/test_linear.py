"""linear: y = scale * (act(x @ W^T + b) [+ residual]) against F.linear and PyTorch's activations (swiglu: F.silu of
the gate's rows times the value's), through each of its two kernels (the plain one for matrices that are not 16-byte
aligned, the TMA one for those that are); linear_partials and split_k (split K); whole_wave_rows (a short last
wave's rows launched apart); training's forward outputs (pre_out, col_scale, row_scale) and linear_backward against
torch autograd of the same composed function."""

import importlib
import itertools
import math
import threading
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import triton

from tests.kernels.checks import (
    TF32_WEIGHT_PATHS, assert_like_torch, assert_written_in_place, check, each_dtype, empty, inference, nan_filled, rand,
    raises_value_error, reference, tf32_emulated, tf32_matmuls,
)
from tests.numerics import DEVICE, DTYPES, assert_close
from vit_triton.kernels import ACTIVATIONS, linear, linear_backward, linear_partials, split_k
from vit_triton.kernels import activation as ACTIVATION
from vit_triton.kernels import tf32 as TF32
from vit_triton.kernels.common import sm_count
from vit_triton.kernels.tuning import Config
from vit_triton.kernels.linear import (
    BACKWARD, FLOAT32, INTERPRETER, LARGE_M, MAX_SPLITS, PLAIN, PLAIN_FLOAT32, SMALL_M, SPLIT_MAX_TILES, SPLIT_MIN_DEPTH,
    SPLIT_PROGRAMS, SPLIT_TILE, TINY_M, whole_wave_rows,
)
from vit_triton.kernels.tf32 import TF32_WEIGHT_ROWS
from vit_triton.model.reference import activation as reference_activation
from vit_triton.model.reference import rope_reference

LINEAR = importlib.import_module("vit_triton.kernels.linear")   # the module; the package exports the function


TORCH_ACTIVATIONS = {   # each on the product; swiglu's on its gate
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda y: y * torch.sigmoid(1.702 * y),
    "swiglu": F.silu,
}


def torch_linear(act, scale=1.0):
    """PyTorch's sequence of ops, each rounding to the inputs' precision as a PyTorch model would. swiglu: the
    gate's rows are weight[0::2] (and bias[0::2]), the value's weight[1::2]."""
    def fn(x, w, b, r):
        if act == "swiglu":
            gate, value = (F.linear(x, w[i::2], None if b is None else b[i::2]) for i in (0, 1))
            y = F.silu(gate) * value
        else:
            y = TORCH_ACTIVATIONS[act](F.linear(x, w, b))
        return scale * (y if r is None else y + r)
    return fn


def inputs(m, n, k, dtype, bias=True, residual=True, strided=False, kernel=None, gated=False):
    """x [m, k], weight [n, k], bias [n], residual [m, n]; gated (swiglu): weight [2n, k] and bias [2n]. strided: x
    and the residual are views with rows further apart than their width, as the class tokens tokens[:, 0] of a
    [B, T, D] tensor. kernel: x, weight and residual laid out for that kernel of linear's (laid_out)."""
    rows = 2 * n if gated else n
    x = rand(m, 3, k, dtype=dtype)[:, 0] if strided else rand(m, k, dtype=dtype)
    r = (rand(m, 2, n, dtype=dtype)[:, 1] if strided else rand(m, n, dtype=dtype)) if residual else None
    w = rand(rows, k, dtype=dtype, scale=k ** -0.5)
    if kernel is not None:
        x, w, r = (None if t is None else laid_out(t, kernel) for t in (x, w, r))
    return x, w, rand(rows, dtype=dtype) if bias else None, r


# linear runs its TMA kernel where every matrix is 16-byte aligned (base address and row stride), else its plain
# kernel: the tests that run both take these layouts, whatever the sizes.
KERNELS = pytest.mark.parametrize("kernel", ["plain", "tma"])
KERNEL_NAMES = {"plain": "_linear_plain_kernel", "tma": "_linear_tma_kernel"}


def laid_out(t, kernel):
    """A copy of the matrix t, read in place from a view: for "tma", rows padded to a multiple of 16 bytes (so
    aligned, whatever the width); for "plain", a column slice one element into its rows, which no TMA
    descriptor can read."""
    rows, cols = t.shape
    if kernel == "tma":
        per_16_bytes = 16 // t.element_size()
        view = t.new_empty(rows, -(-cols // per_16_bytes) * per_16_bytes)[:, :cols]
    else:
        view = t.new_empty(rows, cols + 1)[:, 1:]
    return view.copy_(t)


def output(m, n, dtype, kernel):
    """An out= [m, n] for linear laid out for that kernel, filled with NaN (laid_out)."""
    return laid_out(nan_filled(m, n, dtype=dtype), kernel)


@pytest.fixture
def ran(monkeypatch):
    """The names of the linear kernels (forward and backward GEMMs) launched during the test, in order."""
    names = []
    for kernel in (LINEAR._linear_plain_kernel, LINEAR._linear_tma_kernel, LINEAR._linear_backward_plain_kernel,
                   LINEAR._linear_backward_tma_kernel):
        run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *args, run=run, name=kernel.fn.__name__, **kwargs:
                            names.append(name) or run(*args, **kwargs))
    return names


EPILOGUES = list(itertools.product((True, False), ACTIVATIONS, (True, False)))


@each_dtype
@KERNELS
@pytest.mark.parametrize("bias, act, residual", EPILOGUES,
                         ids=[f"{'bias' if b else 'nobias'}-{a}-{'residual' if r else 'noresidual'}"
                              for b, a, r in EPILOGUES])
def test_every_epilogue(dtype, kernel, bias, act, residual, ran):
    # M, N, K none a multiple of any tile (swiglu: W's 90 rows make 45 columns of y); x, W, the residual and out
    # read and written in place through views.
    x, w, b, r = inputs(37 * 3, 45, 53, dtype, bias, residual, kernel=kernel, gated=act == "swiglu")
    out = output(37 * 3, 45, dtype, kernel)
    check(linear(x, w, b, activation=act, residual=r, out=out), torch_linear(act), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}


SHAPES = [(1, 7, 3, "gelu"), (5, 96, 384, "none"), (37 * 3, 3 * 96, 96, "gelu_tanh"), (257, 45, 53, "quick_gelu"),
          (197 * 3, 3 * 96, 96, "none"), (111, 1000, 64, "gelu"), (1, 7, 3, "swiglu"), (257, 45, 53, "swiglu"),
          (197, 500, 97, "swiglu")]


@each_dtype
@KERNELS
@pytest.mark.parametrize("m, n, k, act", SHAPES)
def test_odd_shapes(dtype, kernel, m, n, k, act, ran):
    x, w, b, r = inputs(m, n, k, dtype, kernel=kernel, gated=act == "swiglu")
    out = output(m, n, dtype, kernel)
    check(linear(x, w, b, activation=act, residual=r, out=out), torch_linear(act), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}


def interleaved(gate, value):
    """swiglu's weight [2n, k] (or bias [2n]) from the gate's and the value's: row 2j gate[j], row 2j + 1 value[j]."""
    return torch.stack([gate, value], 1).flatten(0, 1)


def activation_alone(x, act):
    """act of each element of x [m, 16], through linear: y = x @ I, or for swiglu a gate of x @ I and a value of
    0 @ x + 1, so that y = silu(x)."""
    eye = torch.eye(16, device=DEVICE, dtype=x.dtype)
    if act != "swiglu":
        return linear(x, eye, activation=act, allow_tf32=False)
    ones = torch.ones(16, device=DEVICE, dtype=x.dtype)
    return linear(x, interleaved(eye, 0 * eye), interleaved(0 * ones, ones), activation=act, allow_tf32=False)


# Far left, the sigmoid forms' 2^(...) overflows to inf and 1 / (1 + inf) = 0, the right limit;
# NumPy, running the interpreter, warns about it.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("act", ACTIVATIONS[1:])
def test_activation_over_its_range(act):
    # Every activation evaluated at 16 * 997 points of [-12, 12] in float32, held to float64 PyTorch within
    # 1e-6 + 4e-6 |y| (the erfc approximation, the SFU's exp2 and reciprocal).
    x = torch.linspace(-12, 12, 997 * 16, device=DEVICE).view(997, 16)
    out = activation_alone(x, act)
    torch.testing.assert_close(out.double(), TORCH_ACTIVATIONS[act](x.double()), atol=1e-6, rtol=4e-6)


# The one-tanh forms of 16-bit outputs, h + h tanh(u), h = x / 2: exact GELU's fit is within 2.72e-4 of it (bf16,
# degree 3) or 2.8e-5 (fp16, degree 5), the other two are exact forms. On a GPU the tanh is within 1e-5 of tanh
# (relative; 9.9e-6 measured on an H100), so the result within 1e-5 |h| more. The rest is y's rounding, at most
# half an ulp.
GELU_FIT_DEGREE_FIT_ERROR = {3: 2.72e-4, 5: 2.8e-5}
TANH_ERROR = 1e-5
SIXTEEN_BIT_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")   # x * x at bf16's largest
@SIXTEEN_BIT_DTYPES
@pytest.mark.parametrize("act", ACTIVATIONS[1:])
def test_16bit_activation_over_its_range(act, dtype):
    # x exact in dtype: every activation at 16 * 997 points of [-12, 12] and at dtype's largest and smallest
    # values (no overflow inside), held to float64 PyTorch within the fit's and the tanh's error plus half an
    # ulp of y.
    largest = torch.finfo(dtype).max
    x = torch.cat([torch.linspace(-12, 12, 997 * 16 - 2), torch.tensor([largest, -largest])])
    x = x.to(DEVICE, dtype).view(997, 16)
    out = activation_alone(x, act).double()
    ref = TORCH_ACTIVATIONS[act](x.double())
    half_ulp = torch.finfo(dtype).eps / 2   # relative
    fit_error = GELU_FIT_DEGREE_FIT_ERROR[ACTIVATION.GELU_FIT_DEGREES[dtype]] if act == "gelu" else 0.0
    allowed = (fit_error + TANH_ERROR * x.double().abs() / 2) * (1 + half_ulp) + half_ulp * ref.abs()
    excess = (out - ref).abs() - allowed
    assert excess.max() <= 0, f"{act} off by {excess.max():.2e} more than allowed at x = {x.flatten()[excess.argmax()]}"


@SIXTEEN_BIT_DTYPES
@pytest.mark.parametrize("gelu_fit_degree", [False, True], ids=["erf", "one-tanh"])
def test_one_tanh_form_only_where_asked(dtype, gelu_fit_degree, monkeypatch):
    # Without the one-tanh form, GELU is the erf form's to the bit of float32 rounded once; with it, it differs
    # where the fit's error crosses a rounding boundary.
    x = torch.linspace(-6, 6, 4096, device=DEVICE).view(256, 16).to(dtype)
    erf_form = linear(x.float(), torch.eye(16, device=DEVICE), activation="gelu", allow_tf32=False).to(dtype)
    if not gelu_fit_degree:
        monkeypatch.setattr(ACTIVATION, "GELU_FIT_DEGREES", {})
    out = linear(x, torch.eye(16, device=DEVICE, dtype=dtype), activation="gelu")
    assert torch.equal(out, erf_form) != gelu_fit_degree


@each_dtype
@KERNELS
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_output_scale_applies_after_the_residual(dtype, kernel, act, ran):
    x, w, b, r = inputs(29, 41, 33, dtype, kernel=kernel, gated=act == "swiglu")
    out = linear(x, w, b, activation=act, residual=r, scale=0.5, out=output(29, 41, dtype, kernel))
    check(out, torch_linear(act, scale=0.5), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}


@KERNELS
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("allow_tf32", [True, None, False], ids=["tf32", "global", "ieee"])
def test_float32_matmul_precision(allow_tf32, act, kernel, ran):
    # PyTorch set to tf32 for float32 matmuls: None follows that setting, False overrides it.
    x, w, b, r = inputs(37 * 3, 45, 96, torch.float32, kernel=kernel, gated=act == "swiglu")
    fn = torch_linear(act)
    with tf32_matmuls():
        out = linear(x, w, b, activation=act, residual=r, allow_tf32=allow_tf32,
                     out=output(37 * 3, 45, torch.float32, kernel))
        torch_out = fn(x, w, b, r)
    ref = reference(fn, x, w, b, r)
    if allow_tf32 is False:
        assert_close(out, ref, torch.float32)
    else:
        # tf32 keeps 10 mantissa bits: held to 1.5x PyTorch's own error with tf32 on. A CPU has no
        # tf32, so there PyTorch's is emulated: operands rounded to nearest tf32 (as cuBLAS does).
        if DEVICE.type != "cuda":
            torch_out = fn(tf32_emulated(x), tf32_emulated(w), b, r)
        assert_like_torch(out, ref, torch_out)
    assert set(ran) == {KERNEL_NAMES[kernel]}


@TF32_WEIGHT_PATHS
@pytest.mark.parametrize("operand", ["x", "weight"])
def test_tf32_operands_are_rounded_not_truncated(large, inference_weight, operand):
    # Operands just under a tf32 rounding boundary: truncating them would make every product low,
    # a bias that grows with K; rounding them keeps the sum as close as cuBLAS gets it.
    near = 1.0 + 2 ** -10 - 2 ** -22
    rows = TF32_WEIGHT_ROWS if large else TF32_WEIGHT_ROWS - 1
    x = torch.full((rows, 256), near if operand == "x" else 1.0, device=DEVICE)
    w = torch.full((32, 256), near if operand == "weight" else 1.0, device=DEVICE)
    out = linear(x, inference(w) if inference_weight else w, allow_tf32=True)
    assert torch.equal(out, torch.full_like(out, 256 * (1.0 + 2 ** -10))), out[0, 0].item()


def test_every_weight_path_gives_the_same_bits(monkeypatch, one_config):
    # One launch config for all, so that only where W is rounded differs: the kept copy, a copy for
    # the call, and the K loop (an inference tensor, with the row threshold out of reach).
    x, w, b, r = inputs(TF32_WEIGHT_ROWS + 3, 45, 53, torch.float32, strided=True)
    kept = linear(x, w, b, activation="gelu", residual=r, allow_tf32=True)
    assert torch.equal(kept, linear(x, inference(w), b, activation="gelu", residual=r, allow_tf32=True))
    monkeypatch.setattr(TF32, "TF32_WEIGHT_ROWS", TF32_WEIGHT_ROWS * 10)
    assert torch.equal(kept, linear(x, inference(w), b, activation="gelu", residual=r, allow_tf32=True))


@each_dtype
@KERNELS
def test_every_element_is_written_in_place(dtype, kernel, ran):
    x, w, b, r = inputs(70, 33, 40, dtype, kernel=kernel)
    buffer = nan_filled(70, 48, dtype=dtype)
    first = 8 if kernel == "tma" else 3                 # 16 or 32 bytes in: aligned; 3 elements in: not
    out = buffer[:, first:first + 33]                   # rows 48 apart: only the view may be written
    result = linear(x, w, b, activation="gelu_tanh", residual=r, out=out)
    assert_written_in_place(result, out, buffer)
    check(result, torch_linear("gelu_tanh"), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}


@pytest.mark.parametrize("change, message", [
    (dict(w=empty(6, 8, dtype=torch.bfloat16)), "weight must be torch.float32, got torch.bfloat16"),
    (dict(b=empty(6, dtype=torch.float16)), "bias must be torch.float32, got torch.float16"),
    (dict(x=empty(5, 8).long()), "x must be float32, float16 or bfloat16, got torch.int64"),
    (dict(w=empty(6, 7)), "weight must have shape (6, 8), got (6, 7)"),
    (dict(b=empty(5)), "bias must have shape (6,), got (5,)"),
    (dict(x=empty(1, 5, 8)), "x must be 2-D [M, K] with unit stride along K, got shape (1, 5, 8)"),
    (dict(x=empty(8, 5).t()), "x must be 2-D [M, K] with unit stride along K, got shape (5, 8) and strides (1, 5)"),
    (dict(act="relu"), "activation must be one of ('none', 'gelu', 'gelu_tanh', 'quick_gelu', 'swiglu'), got 'relu'"),
    (dict(act="swiglu", w=empty(7, 8), b=empty(7)),
     "swiglu's weight must have shape [2N, 8], the gate's and the value's rows interleaved, got (7, 8)"),
    (dict(act="swiglu"), "residual must have shape (5, 3), got (5, 6)"),   # y is half as wide as W is tall
    (dict(act="swiglu", r=None, out=empty(5, 6)), "out must have shape (5, 3), got (5, 6)"),
    (dict(r=empty(5, 7)), "residual must have shape (5, 6), got (5, 7)"),
    (dict(r=empty(6, 5).t()), "residual must have unit stride along N, got strides (1, 5)"),
    (dict(r=empty(5, 6, dtype=torch.float16)), "residual must be torch.float32, got torch.float16"),
    (dict(out=empty(6, 5)), "out must have shape (5, 6), got (6, 5)"),
    (dict(out=empty(5, 6, dtype=torch.bfloat16)), "out must be torch.float32, got torch.bfloat16"),
])
def test_bad_input(change, message):
    args = dict(zip("xwbr", inputs(5, 6, 8, torch.float32)), act="none", out=None) | change
    with raises_value_error(message):
        linear(args["x"], args["w"], args["b"], activation=args["act"], residual=args["r"], out=args["out"])


# Rotary embeddings in a QKV projection's epilogue: interleaved pairs and rotate_half, with 0, 1 (class token) and 5
# (class + 4 registers) tokens left unrotated, head dims 16 (half: tiles hold two heads), 32 and 64 (half: the tile
# widened to the head), tables shared or one a head; 2 images of 20 or 37 tokens; each case through both kernels.
ROPE_CASES = [
    (half, prefix, d, (20, 37)[(i + j + half) % 2], DTYPES[(i + j + 2 * half) % 3], (i + half) % 2 == 1, kernel)
    for half in (False, True) for i, prefix in enumerate((0, 1, 5)) for j, d in enumerate((16, 32, 64))
    for kernel in ("plain", "tma") if (i + j) % 2 == (kernel == "tma") or d == 64]


def rope_tables(tokens, head_dim, heads=None):
    """cos, sin [T, Dh] (or [H, T, Dh]) of random angles, each channel its own: the rotation reads the table at a
    pair's first channel only, as the tables' layout repeats it there (linear's docstring)."""
    angles = torch.rand(*((heads,) if heads else ()), tokens, head_dim, device=DEVICE) * 2 * math.pi
    return angles.cos(), angles.sin()


def torch_rope_linear(tokens, heads, half, prefix):
    """F.linear rounded to the inputs' dtype, then rope_reference on q and k, with the tables read at each pair's
    first channel."""
    def fn(x, w, b, cos, sin):
        y = F.linear(x, w, b).view(-1, tokens, 3, heads, w.shape[0] // 3 // heads)
        d = torch.arange(cos.shape[-1])
        first = d % (len(d) // 2) if half else d // 2 * 2
        cos, sin = cos[..., first], sin[..., first]
        q, k = (rope_reference(y[:, :, i], cos, sin, half, prefix) for i in (0, 1))
        return torch.stack([q, k, y[:, :, 2]], 2).flatten(0, 1).flatten(1)
    return fn


@pytest.mark.parametrize("half, prefix, head_dim, tokens, dtype, per_head, kernel", ROPE_CASES,
                         ids=[f"{'half' if h else 'interleaved'}-prefix{p}-Dh{d}-T{t}-{str(dt)[6:]}"
                              f"{'-per-head' if ph else ''}-{k}" for h, p, d, t, dt, ph, k in ROPE_CASES])
def test_rope(half, prefix, head_dim, tokens, dtype, per_head, kernel, ran):
    heads = 2
    x, w, b, _ = inputs(2 * tokens, 3 * heads * head_dim, 53, dtype, residual=False, kernel=kernel)
    out = output(2 * tokens, 3 * heads * head_dim, dtype, kernel)
    cos, sin = rope_tables(tokens - prefix, head_dim, heads if per_head else None)
    y = linear(x, w, b, rope=(cos, sin), rope_half=half, rope_prefix=prefix, out=out)
    check(y, torch_rope_linear(tokens, heads, half, prefix), x, w, b, cos, sin)
    assert set(ran) == {KERNEL_NAMES[kernel]}


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
def test_rope_across_a_short_last_wave(half, monkeypatch):
    # 2 images of 35 tokens, 3 column tiles of 32: 9 tiles on 4 programs under the interpreter, so rows 0-63 go in
    # one launch and rows 64-69 (tokens 29-34 of the second image) in another, which must know where they start.
    x, w, b, _ = inputs(70, 96, 40, torch.float32, residual=False)
    cos, sin = rope_tables(34, 16)
    launches = []
    launch = LINEAR.launch_linear
    monkeypatch.setattr(LINEAR, "launch_linear",
                        lambda config, x, *args: launches.append(x.shape[0]) or launch(config, x, *args))
    y = linear(x, w, b, rope=(cos, sin), rope_half=half, rope_prefix=1)
    check(y, torch_rope_linear(35, 2, half, 1), x, w, b, cos, sin)
    if DEVICE.type == "cpu":
        assert launches == [64, 6]


def test_rope_with_tf32_output_rounds_after_rotating(one_config):
    # The stored q and k are tf32 values (13 low bits clear), each the rounding of the rotated product: within half a
    # tf32 step of the float32 output, give or take what another build's FMAs change in the unrounded value.
    x, w, b, _ = inputs(40, 96, 64, torch.float32, residual=False)
    cos, sin = rope_tables(19, 16)
    with tf32_matmuls():
        y = linear(x, w, b, rope=(cos, sin), rope_prefix=1, tf32_output=True)
        unrounded = linear(x, w, b, rope=(cos, sin), rope_prefix=1)
    assert not (y.view(torch.int32) & 0x1FFF).any()
    torch.testing.assert_close(y, unrounded, rtol=2 ** -11, atol=1e-5)
    assert not torch.equal(y, unrounded)


@pytest.mark.parametrize("change, message", [
    (dict(act="gelu"), "rope rotates a QKV projection: it takes no activation, residual or scale, got activation "
                       "'gelu', no residual and scale 1.0"),
    (dict(r=empty(10, 96)), "got activation 'none', a residual and scale 1.0"),
    (dict(cos=empty(4, 16)), "rope cos and sin must have one shape [(H,) T - rope_prefix, Dh], got (4, 16) and (4, 32)"),
    (dict(cos=empty(4, 32, dtype=torch.float16), sin=empty(4, 32, dtype=torch.float16)),
     "rope cos must be torch.float32, got torch.float16"),
    (dict(sin=empty(32, 4).t()), "rope sin must be contiguous, got strides (1, 4)"),
    (dict(cos=empty(4, 30), sin=empty(4, 30)), "rope needs y's 96 columns as [3, H, Dh] (q, k, v) with an even Dh, "
                                               "cos.shape[-1], and H tables a head if any, got tables of shape (4, 30)"),
    (dict(cos=empty(3, 4, 16), sin=empty(3, 4, 16)), "got tables of shape (3, 4, 16)"),
    (dict(cos=empty(4, 48), sin=empty(4, 48), w=empty(144, 8), b=empty(144), half=True),
     "rope_half needs a head dim that is a power of two up to 128, got 48"),
    (dict(prefix=2), "rope needs x's 10 rows as [B, T] with T = rope_prefix + cos.shape[-2] = 2 + 4 and "
                     "rope_prefix >= 0"),
])
def test_bad_rope(change, message):
    args = dict(zip("xwb", inputs(10, 96, 8, torch.float32, residual=False)), act="none", r=None,
                cos=empty(4, 32), sin=empty(4, 32), half=False, prefix=1) | change
    with raises_value_error(message):
        linear(args["x"], args["w"], args["b"], activation=args["act"], residual=args["r"],
               rope=(args["cos"], args["sin"]), rope_half=args["half"], rope_prefix=args["prefix"])


PARTIAL_SHAPES = [(1, 7, 3, 1), (37, 45, 100, 2), (197, 96, 384, 3), (70, 33, 257, 4), (29, 40, 33, 4)]


@each_dtype
@KERNELS
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("m, n, k, splits", PARTIAL_SHAPES)
def test_partial_sums_add_up_to_the_product(dtype, kernel, bias, m, n, k, splits, ran):
    # K not a multiple of the slices' depth: the last slice runs past K (and reads zeros), or has no
    # K at all (33 deep in 4 slices of 32-deep steps); the bias lies in slice 0 only. x and W are read in
    # place from views; the TMA kernel's N is a multiple of 4, so that the fp32 parts' rows are aligned.
    n = -(-n // 4) * 4 if kernel == "tma" else n
    x, w, b, _ = inputs(m, n, k, dtype, bias, residual=False, kernel=kernel)
    parts = linear_partials(x, w, b, splits)
    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    check(parts.sum(0).to(dtype), torch_linear("none"), x, w, b, None)
    assert set(ran) == {KERNEL_NAMES[kernel]}


@pytest.mark.parametrize("splits", [0, MAX_SPLITS + 1])
def test_bad_splits(splits):
    x, w, b, _ = inputs(5, 6, 8, torch.float32)
    with raises_value_error(f"splits must be between 1 and {MAX_SPLITS}, got {splits}"):
        linear_partials(x, w, b, splits)


def test_split_k_cuts_deep_products_of_few_tiles():
    sms = sm_count(DEVICE)
    most = SPLIT_MAX_TILES * sms            # tiles a product may have and still be cut
    deep = MAX_SPLITS * SPLIT_MIN_DEPTH     # deep enough for every slice count
    assert split_k(SPLIT_TILE, SPLIT_TILE, deep, DEVICE) == MAX_SPLITS             # one tile: the most slices
    assert split_k(SPLIT_TILE, SPLIT_TILE, 3 * SPLIT_MIN_DEPTH, DEVICE) == 3       # no slice shallower
    assert split_k(SPLIT_TILE, SPLIT_TILE, 2 * SPLIT_MIN_DEPTH - 1, DEVICE) == 1   # slices too shallow
    # as many slices as keep SPLIT_PROGRAMS programs an SM: tiles x slices <= SPLIT_PROGRAMS x SMs
    for tiles in range(1, most + 1):
        expected = max([s for s in range(2, MAX_SPLITS + 1) if tiles * s <= SPLIT_PROGRAMS * sms], default=1)
        assert split_k(SPLIT_TILE * tiles - 1, SPLIT_TILE, deep, DEVICE) == expected, tiles
    assert split_k(SPLIT_TILE * most + 1, SPLIT_TILE, deep, DEVICE) == 1           # one tile too many


@each_dtype
@KERNELS
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_every_candidate_config(dtype, kernel, act, monkeypatch, ran):
    # Each launch config a GPU's tuner may pick for each kernel, alone, at a shape none of its tiles divides:
    # the TMA kernel's and the plain kernel's. Every one fits Hopper's shared memory with a residual tile (the TMA
    # kernel's y goes through pointers): none may raise OutOfResources.
    n = 36 if act == "swiglu" else 72   # W's rows: 72
    x, w, b, r = inputs(133, n, 56, dtype, kernel=kernel, gated=act == "swiglu")
    out = output(133, n, dtype, kernel)
    if kernel == "plain":
        configs = PLAIN_FLOAT32 if dtype == torch.float32 else PLAIN
    else:
        configs = FLOAT32 if dtype == torch.float32 else list(dict.fromkeys(LARGE_M + SMALL_M + TINY_M))
    for config in configs:
        monkeypatch.setattr(LINEAR, f"_{kernel}_candidates", lambda m, element, config=config: [config])
        check(linear(x, w, b, activation=act, residual=r, out=out), torch_linear(act), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}


def test_gated_launches_are_tuned_apart(monkeypatch):
    # swiglu's launch at a shape is another build of the kernel than the same product's without it, with
    # another output: it has its own pick.
    keys = []
    pick = LINEAR._TUNER.pick
    monkeypatch.setattr(LINEAR._TUNER, "pick", lambda key, *args: keys.append(key) or pick(key, *args))
    x, w, b, _ = inputs(37, 24, 40, torch.bfloat16, residual=False)
    for act in ("none", "swiglu"):
        linear(x, w, b, activation=act)
    assert len(keys) == 2 and keys[0] != keys[1]


def test_whole_wave_rows_splits_a_short_last_wave_of_a_shallow_launch():
    sms = sm_count(DEVICE)   # 4 under the interpreter, so a last wave of one tile is at most 30% full
    config = Config(32, 64, 32, 4, 1)   # N = 64: one column of tiles, a tile a row block of 32
    assert whole_wave_rows(32 * sms + 5, 64, config, DEVICE) == 32 * sms            # one wave and 5 rows
    assert whole_wave_rows(32 * (2 * sms + 1), 64, config._replace(persistent=2), DEVICE) == 64 * sms
    assert whole_wave_rows(32 * 2 * sms, 64, config, DEVICE) == 64 * sms            # whole waves: as it is
    fuller = 32 * (sms + int(0.3 * sms) + 1)                                        # last wave over 30% full
    assert whole_wave_rows(fuller, 64, config, DEVICE) == fuller
    deep = 32 * (8 * sms + 1)                                                       # idle under an eighth
    assert whole_wave_rows(deep, 64, config, DEVICE) == deep
    assert whole_wave_rows(32 * (sms - 1), 64, config, DEVICE) == 32 * (sms - 1)   # under one wave


@each_dtype
@KERNELS
def test_short_last_wave_launched_apart(dtype, kernel, monkeypatch, ran):
    # Two waves and a last of one tile of 32 x 32 under the interpreter (4 programs): the rows of the two
    # waves in one launch, the last rows (strided views of strided views) in another, both right, and both
    # through the kernel that the whole product's layout takes.
    m, n = 70, 70
    x, w, b, r = inputs(m, n, 53, dtype, kernel=kernel)
    out = output(m, n, dtype, kernel)
    linear(x, w, b, activation="gelu", residual=r, out=out)   # on a GPU, the tuner's launches happen here
    launches = []
    launch = LINEAR.launch_linear
    monkeypatch.setattr(LINEAR, "launch_linear",
                        lambda config, x, *args: launches.append((config, x.shape[0])) or launch(config, x, *args))
    check(linear(x, w, b, activation="gelu", residual=r, out=out), torch_linear("gelu"), x, w, b, r)
    rows = whole_wave_rows(m, n, launches[0][0], DEVICE)
    assert [launched for _, launched in launches] == ([m] if rows == m else [rows, m - rows])
    if launches[0][0] == INTERPRETER:
        assert rows == 64
    assert set(ran) == {KERNEL_NAMES[kernel]}


def test_runs_from_a_new_thread(ran):
    # Aligned inputs take the TMA path. Its descriptors are built on the host, so no per-thread Triton
    # state (the scratch allocator that in-kernel descriptors need lives in a ContextVar, which a new
    # thread starts without) is needed: a serving loop's worker thread can call linear.
    x, w, b, r = inputs(128, 64, 96, torch.bfloat16)
    results = []
    worker = threading.Thread(target=lambda: results.append(linear(x, w, b, residual=r)))
    worker.start()
    worker.join()
    assert len(results) == 1, "linear raised in the new thread"
    check(results[0], torch_linear("none"), x, w, b, r)
    assert set(ran) == {"_linear_tma_kernel"}


@pytest.mark.parametrize("layout, kernel", [
    ("contiguous", "tma"), ("class-token views", "tma"),   # every row 16-byte aligned
    ("x column slice", "plain"), ("x odd row stride", "plain"), ("weight column slice", "plain"),
    ("residual column slice", "plain"), ("out column slice", "plain"),
])
def test_the_kernel_follows_the_alignment(layout, kernel, ran):
    # The TMA kernel where every matrix has a 16-byte aligned base and row stride (bf16 rows of 96 and 128
    # bytes here, or the class tokens of [m, 3, k] and [m, 2, n] tensors), else the plain kernel: one matrix a
    # column slice one element in, or x's rows 130 bytes apart, is enough.
    m, n, k = 40, 48, 64
    x, w, b, r = inputs(m, n, k, torch.bfloat16, strided=layout == "class-token views")
    matrices = dict(x=x, weight=w, residual=r, out=empty(m, n, dtype=torch.bfloat16))
    if layout == "x odd row stride":
        matrices["x"] = rand(m, k + 1, dtype=torch.bfloat16)[:, :k]
    elif layout.endswith("column slice"):
        name = layout.split()[0]
        matrices[name] = laid_out(matrices[name], "plain")
    x, w, r, out = matrices.values()
    check(linear(x, w, b, residual=r, out=out), torch_linear("none"), x, w, b, r)
    assert set(ran) == {KERNEL_NAMES[kernel]}



# ------------------------------------------------------------------------------------------------------ training
# The forward's training outputs, and linear_backward against torch autograd of the same composed function,
# y = scale * (r * gamma * act(x' @ W^T + b) + residual) with x' = x_act(x_pre) (the fused MLP backward): in float64 on
# the CPU from the very same inputs, and in the inputs' precision for the 16-bit rule. The plain kernel's cases have
# widths no TMA descriptor can read (45, 53, 769: dz, dx and dW are made contiguous), the TMA kernel's widths of 8k.

BACKWARD_NAMES = {"plain": "_linear_backward_plain_kernel", "tma": "_linear_backward_tma_kernel"}
KEEP = 0.8   # drop path's keep probability: 1 / KEEP = 1.25, exact in every dtype


def drop_path_scale(m):
    """row_scale [m] float32: 0 or 1 / KEEP a row, both present."""
    keep = torch.rand(m, device=DEVICE) < KEEP
    keep[0], keep[-1] = True, m == 1
    return keep.float() / KEEP


def composed(act="none", scale=1.0, x_act="none", matmul=F.linear):
    """PyTorch's sequence of ops for linear (gamma: col_scale, r: row_scale) and its input's activation, each rounding
    to the inputs' precision as a PyTorch model would. matmul: F.linear, or TF32Linear.apply."""
    def fn(x, w, b=None, gamma=None, r=None, residual=None):
        if x_act != "none":
            x = reference_activation(x, x_act)
        y = reference_activation(matmul(x, w, b), act)
        if gamma is not None:
            y = y * gamma
        if r is not None:
            y = y * r[:, None].to(y.dtype)
        return scale * (y if residual is None else y + residual)
    return fn


class TF32Linear(torch.autograd.Function):
    """F.linear whose three matmuls (forward, dx, dW) take operands rounded to tf32, as cuBLAS's on tf32 does: PyTorch's
    own tf32 result on a CPU, which has none."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear(tf32_emulated(x), tf32_emulated(w), b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        rounded = tf32_emulated(dy)
        return rounded @ tf32_emulated(w), rounded.t() @ tf32_emulated(x), dy.sum(0)


def check_gradients(grads: dict, fn, dy, torch_fn=None, **inputs):
    """Each gradient of grads (input name -> ours) against torch autograd of fn(**inputs) along dy: float64 on the CPU
    for the reference, the inputs' precision on DEVICE for PyTorch's own (through torch_fn where given)."""
    def autograd(convert, fn):
        leaves = {name: None if t is None else convert(t).detach().requires_grad_(name in grads)
                  for name, t in inputs.items()}
        return torch.autograd.grad(fn(**leaves), [leaves[name] for name in grads], convert(dy))

    ref = autograd(lambda t: t.to("cpu", torch.float64), fn)
    torch_out = autograd(lambda t: t, torch_fn or fn)
    for (name, ours), expected, theirs in zip(grads.items(), ref, torch_out):
        assert ours is not None and ours.dtype == inputs[name].dtype and ours.shape == inputs[name].shape, name
        try:
            assert_close(ours, expected, ours.dtype, theirs)
        except AssertionError as error:
            raise AssertionError(f"d{name}: {error}") from None


def backward_inputs(m, n, k, dtype, kernel, gated=False):
    """x [m, k], weight [n, k] ([2n, k] gated), bias, dy [m, n], the matrices laid out for that kernel."""
    x, w, b, _ = inputs(m, n, k, dtype, residual=False, kernel=kernel, gated=gated)
    return x, w, b, laid_out(rand(m, n, dtype=dtype), kernel)


# (activation, with col_scale): two a dtype and kernel, in turn; every case has a row scale, a residual and a scale.
FORWARD_EXTRAS = [("none", True), ("none", False), ("gelu", False), ("swiglu", False), ("quick_gelu", False)]
FORWARD_CASES = [(dtype, kernel, *case) for i, (dtype, kernel) in enumerate(itertools.product(DTYPES, ("plain", "tma")))
                 for case in FORWARD_EXTRAS[i % 4: i % 4 + 2]]


@pytest.mark.parametrize("dtype, kernel, act, col_scale", FORWARD_CASES,
                         ids=[f"{str(d)[6:]}-{k}-{a}{'-gamma' if c else ''}" for d, k, a, c in FORWARD_CASES])
def test_forward_training_outputs(dtype, kernel, act, col_scale, ran):
    # pre_out holds z = x W^T + b rounded (before the activation), and y the column and row scales applied before the
    # residual and the scale; through each kernel and each whole-wave part of a launch (70 rows: 64 + 6 under the
    # interpreter, at every kernel's tile).
    m, n, k = 70, 40 if kernel == "tma" else 45, 53
    gated = act == "swiglu"
    x, w, b, r = inputs(m, n, k, dtype, kernel=kernel, gated=gated)
    gamma = rand(n, dtype=dtype, shift=1.0) if col_scale else None
    rows = drop_path_scale(m)
    pre = output(m, w.shape[0], dtype, kernel)
    y = linear(x, w, b, activation=act, residual=r, scale=0.5, col_scale=gamma, row_scale=rows, pre_out=pre,
               out=output(m, n, dtype, kernel))
    check(y, composed(act, 0.5), x, w, b, gamma, rows, r)
    check(pre, F.linear, x, w, b)
    assert set(ran) == {KERNEL_NAMES[kernel]}


# (activation, dtype, kernel, (m, n, k)): every activation in every dtype, the kernels and shapes in turn; "none"
# takes gamma, the row scale and the output scale, with d gamma.
BACKWARD_SHAPES = {"plain": [(37, 45, 53), (1, 45, 53), (197, 45, 53), (3, 45, 769), (37, 45, 53)],
                   "tma": [(37, 80, 96), (197, 96, 80), (3, 72, 40)]}
BACKWARD_CASES = [(act, dtype, kernel, BACKWARD_SHAPES[kernel][(3 * i + j) // 2 % len(BACKWARD_SHAPES[kernel])])
                  for i, act in enumerate(ACTIVATIONS) for j, dtype in enumerate(DTYPES)
                  for kernel in [("plain", "tma")[(i + j) % 2]]]


@pytest.mark.parametrize("act, dtype, kernel, shape", BACKWARD_CASES,
                         ids=[f"{a}-{str(d)[6:]}-{k}-{'x'.join(map(str, s))}" for a, d, k, s in BACKWARD_CASES])
def test_backward(act, dtype, kernel, shape, ran):
    m, n, k = shape
    x, w, b, dy = backward_inputs(m, n, k, dtype, kernel, gated=act == "swiglu")
    if act == "none":
        gamma, rows, scale, pre = rand(n, dtype=dtype, shift=1.0), drop_path_scale(m), 0.5, None
    else:   # the forward's pre_out, as training keeps it
        gamma, rows, scale, pre = None, None, 1.0, torch.empty(m, w.shape[0], device=DEVICE, dtype=dtype)
        linear(x, w, b, activation=act, pre_out=pre)
    ran.clear()
    dx, dw, db, dgamma = linear_backward(dy, x, w, bias=b, activation=act, pre=pre, scale=scale, col_scale=gamma,
                                         row_scale=rows, need_col_scale=True)
    grads = dict(x=dx, w=dw, b=db) | ({} if gamma is None else dict(gamma=dgamma))
    check_gradients(grads, composed(act, scale), dy, x=x, w=w, b=b, gamma=gamma, r=rows)
    assert set(ran) == {BACKWARD_NAMES[kernel]} and (dgamma is None) == (gamma is None)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("act", ACTIVATIONS[1:])
def test_activation_grad_over_its_range(act):
    # Each derivative at 257 * 16 points of [-12, 12] in float32 (swiglu: gates there, values in [-2, 2]), as dx of
    # linear_backward with an identity weight and dy of ones, held to float64 autograd within 1e-6 + 4e-6 |d|.
    pre = torch.linspace(-12, 12, 257 * 16, device=DEVICE).view(257, 16)
    if act == "swiglu":
        pre = interleaved(pre.t(), torch.linspace(-2, 2, 257 * 16, device=DEVICE).view(16, 257)).t().contiguous()
    eye = torch.eye(pre.shape[1], device=DEVICE)
    dy = torch.ones(257, 16, device=DEVICE)
    dpre, *_ = linear_backward(dy, pre, eye, activation=act, pre=pre, need_dweight=False, allow_tf32=False)
    ref = pre.double().requires_grad_()
    expected, = torch.autograd.grad(reference_activation(ref, act), ref, dy.double())
    torch.testing.assert_close(dpre.double(), expected, atol=1e-6, rtol=4e-6)


# Rotary embeddings' backward: dz is dy turned back by the inverse rotation. Both pair layouts, 0 and 1 prefix tokens,
# tables shared or one a head, each dtype and kernel in turn; head dims 16 and 64 (half: the tile widened to a head).
ROPE_BACKWARD_CASES = [(half, prefix, (16, 64)[(i + half) % 2], DTYPES[(2 * half + i) % 3], i % 2 == half,
                        ("plain", "tma")[(half + i) % 2]) for half in (False, True) for i, prefix in enumerate((0, 1))]


@pytest.mark.parametrize("half, prefix, head_dim, dtype, per_head, kernel", ROPE_BACKWARD_CASES,
                         ids=[f"{'half' if h else 'interleaved'}-prefix{p}-Dh{d}-{str(dt)[6:]}"
                              f"{'-per-head' if ph else ''}-{k}" for h, p, d, dt, ph, k in ROPE_BACKWARD_CASES])
def test_rope_backward(half, prefix, head_dim, dtype, per_head, kernel, ran):
    heads, tokens = 2, 21
    x, w, b, dy = backward_inputs(2 * tokens, 3 * heads * head_dim, 40 if kernel == "tma" else 53, dtype, kernel)
    cos, sin = rope_tables(tokens - prefix, head_dim, heads if per_head else None)
    dx, dw, db, _ = linear_backward(dy, x, w, bias=b, rope=(cos, sin), rope_half=half, rope_prefix=prefix)
    check_gradients(dict(x=dx, w=dw, b=db), torch_rope_linear(tokens, heads, half, prefix), dy, x=x, w=w, b=b,
                    cos=cos, sin=sin)
    assert set(ran) == {BACKWARD_NAMES[kernel]}


# The fused MLP backward (fc2 of fc1 -> act -> fc2): dx is d x_pre = (dz W) * act'(x_pre), made in the dX product's
# epilogue, and x, when None, is recomputed from x_pre there for the dW product; with gamma and the row scale, as
# ops.mlp passes them, in every other case.
FUSED_CASES = [(act, x_given, DTYPES[(i + x_given) % 3], ("plain", "tma")[(i + x_given) % 2])
               for i, act in enumerate(ACTIVATIONS[1:]) for x_given in (False, True)]


@pytest.mark.parametrize("act, x_given, dtype, kernel", FUSED_CASES,
                         ids=[f"{a}-{'x' if x else 'x-recomputed'}-{str(d)[6:]}-{k}" for a, x, d, k in FUSED_CASES])
def test_fused_mlp_backward(act, x_given, dtype, kernel, ran):
    m, n, k = (37, 45, 53) if kernel == "plain" else (37, 40, 48)
    x_pre = laid_out(rand(m, 2 * k if act == "swiglu" else k, dtype=dtype), kernel)
    _, w, b, dy = backward_inputs(m, n, k, dtype, kernel)
    scaled = x_given != (act == "swiglu")
    gamma, rows = (rand(n, dtype=dtype, shift=1.0), drop_path_scale(m)) if scaled else (None, None)
    x = laid_out(reference_activation(x_pre, act), kernel) if x_given else None
    dx_pre, dw, db, dgamma = linear_backward(dy, x, w, bias=b, col_scale=gamma, row_scale=rows, x_activation=act,
                                             x_pre=x_pre, need_col_scale=True)
    check_gradients(dict(x=dx_pre, w=dw, b=db) | (dict(gamma=dgamma) if scaled else {}), composed(x_act=act), dy,
                    x=x_pre, w=w, b=b, gamma=gamma, r=rows)
    assert set(ran) == {BACKWARD_NAMES[kernel]}


@pytest.fixture
def backward_launches(monkeypatch):
    """The constexpr flags of each backward product launched during the test, in order."""
    launches = []
    for kernel in (LINEAR._linear_backward_plain_kernel, LINEAR._linear_backward_tma_kernel):
        run = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *args, run=run, **kwargs: launches.append(kwargs)
                            or run(*args, **kwargs))
    return launches


def test_backward_computes_only_what_is_needed(backward_launches):
    # None for each gradient not needed, and no product for it: a frozen weight, a bias alone (dz's column sums, no
    # product), gamma alone (the dW product without its store), x recomputed for the dW product without dx.
    m, n, k = 37, 45, 53
    x, w, b, dy = backward_inputs(m, n, k, torch.float32, "plain")
    gamma = rand(n, dtype=torch.float32, shift=1.0)
    cases = [   # (arguments, the gradient expected, the launches as (DW, STORE_OUT))
        (dict(need_dweight=False, need_dbias=False), "x", [(False, True)]),
        (dict(need_dx=False, need_dweight=False), "b", []),
        (dict(need_dx=False, need_dweight=False, need_dbias=False, need_col_scale=True), "gamma", [(True, False)]),
        (dict(need_dx=False, need_dbias=False, x_activation="gelu"), "w", [(False, False), (True, True)]),
    ]
    for need, expected, launched in cases:
        backward_launches.clear()
        fused = "x_activation" in need   # this layer's input is gelu(x), recomputed
        grads = linear_backward(dy, None if fused else x, w, bias=b, col_scale=None if fused else gamma,
                                x_pre=x if fused else None, **need)
        assert [name for name, g in zip(("x", "w", "b", "gamma"), grads) if g is not None] == [expected], need
        assert [(launch["DW"], launch["STORE_OUT"]) for launch in backward_launches] == launched, need
        fn = composed(x_act="gelu" if fused else "none")
        check_gradients({expected: next(g for g in grads if g is not None)}, fn, dy, x=x, w=w, b=b,
                        gamma=None if fused else gamma)


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "plain"), (torch.bfloat16, "tma")], ids=["float32-plain",
                                                                                              "bfloat16-tma"])
def test_dweight_product_split_over_rows(dtype, kernel, backward_launches, ran, monkeypatch):
    # One tile of dW (21 x 20, or 24 x 24 for TMA) and 197 rows: cut into slices of at least 32 rows (here, and on a
    # GPU), their fp32 partial sums (dW's, d gamma's) added in one order, so the same bits every run; dbias alone is
    # dz's column sums, with no product.
    monkeypatch.setattr(LINEAR, "DW_SPLIT_MIN_ROWS", 32)
    m, n, k = (197, 21, 20) if kernel == "plain" else (197, 24, 24)
    x, w, b, dy = backward_inputs(m, n, k, dtype, kernel)
    gamma, rows = rand(n, dtype=dtype, shift=1.0), drop_path_scale(m)
    grads = linear_backward(dy, x, w, bias=b, col_scale=gamma, row_scale=rows, need_col_scale=True)
    assert [launch["SPLIT"] > 1 for launch in backward_launches] == [False, True]
    again = linear_backward(dy, x, w, bias=b, col_scale=gamma, row_scale=rows, need_col_scale=True)
    assert all(torch.equal(first, second) for first, second in zip(grads, again))
    check_gradients(dict(zip(("x", "w", "b", "gamma"), grads)), composed(), dy, x=x, w=w, b=b, gamma=gamma, r=rows)
    backward_launches.clear()
    _, _, dbias, _ = linear_backward(dy, x, w, bias=b, col_scale=gamma, row_scale=rows, need_dx=False,
                                     need_dweight=False)
    assert backward_launches == []
    check_gradients(dict(b=dbias), composed(), dy, x=x, w=w, b=b, gamma=gamma, r=rows)
    assert set(ran) == {BACKWARD_NAMES[kernel]}


@pytest.mark.parametrize("kernel, dtype", [("tma", torch.bfloat16), ("tma", torch.float32), ("plain", torch.float16),
                                           ("plain", torch.float32)],
                         ids=["tma-bfloat16", "tma-float32", "plain-float16", "plain-float32"])
def test_every_backward_candidate_config(kernel, dtype, monkeypatch, ran):
    # Each launch config a GPU's tuner may pick for the backward products, alone, at a shape none of its tiles
    # divides, with every epilogue at work: d x_pre and x recomputed (dX), gamma, dbias and d gamma (dW). On a GPU
    # each compiles; one too large for shared memory with these epilogues is skipped, as the tuner skips it, but
    # never the first (a CUDA-graph capture takes it unseen).
    m, n, k = 133, 72, 56
    x_pre = laid_out(rand(m, k, dtype=dtype), kernel)
    _, w, b, dy = backward_inputs(m, n, k, dtype, kernel)
    gamma = rand(n, dtype=dtype, shift=1.0)
    if kernel == "plain":
        configs = PLAIN_FLOAT32 if dtype == torch.float32 else PLAIN
    else:
        configs = FLOAT32 if dtype == torch.float32 else BACKWARD
    for i, config in enumerate(configs):
        monkeypatch.setattr(LINEAR, "_backward_candidates", lambda tma, element, config=config: [config])
        try:
            grads = linear_backward(dy, None, w, bias=b, col_scale=gamma, x_activation="gelu", x_pre=x_pre,
                                    need_col_scale=True)
        except triton.runtime.errors.OutOfResources:
            assert i > 0, f"{config}, the first candidate, does not fit in shared memory"
            continue
        check_gradients(dict(zip(("x", "w", "b", "gamma"), grads)), composed(x_act="gelu"), dy, x=x_pre, w=w, b=b,
                        gamma=gamma)
    assert set(ran) == {BACKWARD_NAMES[kernel]}


@pytest.mark.parametrize("act, kernel", [("none", "plain"), ("gelu", "tma")])
def test_backward_float32_on_tf32(act, kernel, ran):
    # float32 with PyTorch's matmuls on tf32: allow_tf32 None follows it. Held to 1.5x PyTorch's own error (on a CPU,
    # emulated: each matmul's operands rounded to tf32, TF32Linear).
    m, n, k = (37, 45, 53) if kernel == "plain" else (37, 40, 48)
    x, w, b, dy = backward_inputs(m, n, k, torch.float32, kernel)
    gamma = rand(n, dtype=torch.float32, shift=1.0) if act == "none" else None
    pre = None if act == "none" else linear(x, w, b, allow_tf32=False)
    ran.clear()
    torch_fn = composed(act, matmul=F.linear if DEVICE.type == "cuda" else TF32Linear.apply)
    with tf32_matmuls():
        dx, dw, db, dgamma = linear_backward(dy, x, w, bias=b, activation=act, pre=pre, col_scale=gamma,
                                             need_col_scale=True)
        check_gradients(dict(x=dx, w=dw) | (dict(gamma=dgamma) if gamma is not None else {}), composed(act),
                        dy, torch_fn, x=x, w=w, b=b, gamma=gamma)
    # db takes no product, only column sums of float32 values, ours and PyTorch's each in its own order: the float32
    # rule (exact matmuls), not 1.5x PyTorch's error of a few ulps
    check_gradients(dict(b=db), composed(act), dy, torch_fn, x=x, w=w, b=b, gamma=gamma)
    assert set(ran) == {BACKWARD_NAMES[kernel]}


@pytest.mark.parametrize("change, message", [
    (dict(x=None), "x may be None only with an x_activation and x_pre, from which it is recomputed"),
    (dict(activation="relu"), "activation must be one of ('none', 'gelu', 'gelu_tanh', 'quick_gelu', 'swiglu'), "
                              "got 'relu'"),
    (dict(activation="gelu"), "activation 'gelu' needs pre, the forward's pre_out [5, 6]"),
    (dict(activation="swiglu", pre=empty(5, 12)), "weight must have shape (12, 8), got (6, 8)"),
    (dict(x_activation="gelu"), "x_activation 'gelu' needs x_pre, the input of x's activation"),
    (dict(x_activation="swiglu", x_pre=empty(5, 8)), "x_pre must have shape (5, 16), got (5, 8)"),
    (dict(bias=empty(6, dtype=torch.bfloat16)), "bias must be torch.float32, got torch.bfloat16"),
    (dict(col_scale=empty(6), activation="gelu", pre=empty(5, 6)),
     "col_scale scales a product without activation or rope, got activation 'gelu' and no rope"),
    (dict(row_scale=empty(5, dtype=torch.bfloat16)), "row_scale must be torch.float32, got torch.bfloat16"),
    (dict(dy=empty(6, 5).t()), "dy must have unit stride along N, got strides (1, 5)"),
])
def test_bad_backward_input(change, message):
    args = dict(dy=empty(5, 6), x=empty(5, 8), weight=empty(6, 8)) | change
    with raises_value_error(message):
        linear_backward(args.pop("dy"), args.pop("x"), args.pop("weight"), **args)


@pytest.mark.parametrize("change, message", [
    (dict(activation="gelu", col_scale=empty(6)),
     "col_scale scales a product without activation or rope, got activation 'gelu' and no rope"),
    (dict(col_scale=empty(5)), "col_scale must have shape (6,), got (5,)"),
    (dict(row_scale=empty(5).half()), "row_scale must be torch.float32, got torch.float16"),
    (dict(activation="swiglu", pre_out=empty(5, 3)), "pre_out must have shape (5, 6), got (5, 3)"),
])
def test_bad_training_input(change, message):
    x, w, b, _ = inputs(5, 6, 8, torch.float32)
    with raises_value_error(message):
        linear(x, w, b, **change)
