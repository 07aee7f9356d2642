"""scripts/ncu_block.py on a machine without a GPU: its command line, and the reading of ncu's details CSV
(the layout Nsight Compute 2025.3 writes; its counters are read on the device)."""

import csv
import io
from functools import partial

import pytest
import torch

from tests.scripts import load_script, run_script

NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
run = partial(run_script, "ncu_block.py")


@pytest.mark.parametrize("args, message", [
    (["--model", "vit-huge"], "invalid choice: 'vit-huge'"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--batch-sizes", "1,x"], "argument --batch-sizes: expected comma-separated positive integers, got '1,x'"),
    (["--batch-sizes", "0"], "argument --batch-sizes: expected comma-separated positive integers, got '0'"),
])
def test_unknown_choices_are_named(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so():
    result = run("--batch-sizes", "1")
    assert result.returncode == 2 and "ncu_block needs a CUDA device" in result.stderr, result.stderr


def details_csv(rows: list[tuple]) -> str:
    """ncu's details page: one row a metric, (ID, range, kernel, metric, unit, value)."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(["ID", "Process ID", NVTX, "Kernel Name", "Section Name", "Metric Name", "Metric Unit",
                     "Metric Value"])
    for kid, label, kernel, metric, unit, value in rows:
        nvtx = f'563  "<default domain>:{label}:none:none:none:none:none:none" ' if label else ""
        writer.writerow([kid, "563", nvtx, kernel, "Section", metric, unit, value])
    return out.getvalue()


def test_details_are_read_one_entry_a_kernel_in_launch_order_with_units_made_one():
    text = details_csv([
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "Duration", "ms", "1.25"),
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "SM Frequency", "Mhz", "1,680"),
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "Executed Instructions", "inst", "53,874,456"),
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "Memory Throughput", "%", "65.49"),
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "Memory Throughput", "Tbyte/s", "1.10"),
        ("0", "b256_linear_qkv_ours", "_linear_kernel", "Block Limit SM", "block", "32"),   # not in METRICS
        ("1", "b1_layer_norm_torch", "vectorized_layer_norm_kernel", "Duration", "ns", "5,380"),
        ("1", "b1_layer_norm_torch", "vectorized_layer_norm_kernel", "Duration", "ns", "9,999"),   # first kept
        ("2", "", "nvjet_sm90", "Registers Per Thread", "register/thread", "168"),
    ])
    kernels = load_script("ncu_block.py").parse_details(text)
    assert [k["range"] for k in kernels] == ["b256_linear_qkv_ours", "b1_layer_norm_torch", ""]
    assert [k["kernel"] for k in kernels] == ["_linear_kernel", "vectorized_layer_norm_kernel", "nvjet_sm90"]
    qkv, norm, other = (k["metrics"] for k in kernels)
    assert qkv == pytest.approx({"Duration [us]": 1250.0, "SM Frequency [GHz]": 1.68,
                                 "Executed Instructions [inst]": 53874456.0, "Memory Throughput [%]": 65.49,
                                 "Memory Throughput [GB/s]": 1100.0})
    assert norm == pytest.approx({"Duration [us]": 5.38})
    assert other == {"Registers Per Thread [register/thread]": 168.0}
