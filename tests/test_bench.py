"""The bench harness end to end on the tiny model through the interpreter, with a fake clock."""

import itertools
import json
import time

import pytest
import torch

from vit_triton.bench import harness, roofline
from vit_triton.bench.power import Board
from vit_triton.bench.numerics import tolerance
from vit_triton.bench.systems import build_systems
from vit_triton.cli import main
from vit_triton.kernels.common import INTERPRET
from vit_triton.kernels.tuning import repeated
from vit_triton.model import PRESETS

CFG = PRESETS["tiny"]
CPU = torch.device("cpu")
# The harness on the CPU runs vit-triton through Triton's interpreter; on a GPU `vit-triton bench` itself is the check.
on_the_cpu = pytest.mark.skipif(not INTERPRET, reason="vit-triton on the CPU needs TRITON_INTERPRET=1")


def fake_timer(times):
    """Runs each timed function once (so every code path executes) and reports the next fake time."""
    clock = iter(times)

    def timer(fn):
        fn()
        return next(clock)
    return timer


@on_the_cpu
def test_bench_end_to_end(tmp_path):
    # Calls: 2 ceilings, then per batch size: vit-triton, hf, timm.
    times = [1.0, 1.0] + [2.0, 3.0, 5.0] + [4.0, 12.0, 8.0]
    result = harness.run_bench("tiny", CFG, [1, 2], torch.float32, CPU, tmp_path,
                               ("vit-triton", "vit-triton+cudagraph", "hf", "timm"), timer=fake_timer(times),
                               log=lambda s: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert {"model", "config", "dtype", "flops_per_image", "environment", "ceilings", "check", "rows", "skipped",
            "speedup"} <= saved.keys()
    assert {"gpu", "torch", "triton", "date"} <= saved["environment"].keys()
    assert saved["skipped"] == {"vit-triton+cudagraph": "CUDA graphs need a CUDA device"}
    assert saved["check"]["ok"] and saved["check"]["err"] <= 1e-5
    assert [(r["system"], r["batch"], r["ms"]) for r in saved["rows"]] == [
        ("vit-triton", 1, 2.0), ("hf", 1, 3.0), ("timm", 1, 5.0), ("vit-triton", 2, 4.0), ("hf", 2, 12.0),
        ("timm", 2, 8.0)]
    row = saved["rows"][3]
    assert row["images_per_s"] == pytest.approx(2 / 4.0e-3)
    assert row["tflops"] == pytest.approx(2 * saved["flops_per_image"] / 4.0e-3 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops"] / saved["ceilings"]["matmul_tflops"])
    assert saved["ceilings"]["matmul_tflops"] == pytest.approx(2 * 64 ** 3 / 1e-3 / 1e12)
    assert saved["speedup"] == {"1": {"best_peer": "hf", "ours": "vit-triton", "speedup": 1.5},
                                "2": {"best_peer": "timm", "ours": "vit-triton", "speedup": 2.0}}
    table = harness.format_table(result)
    assert "batch 2: vit-triton is 2.00x the best peer (timm)" in table
    assert "skipped vit-triton+cudagraph: CUDA graphs need a CUDA device" in table


class FixedBoard:
    """Stands in for power.Board where there is no NVML (the CPU): each sustained run calls the system once
    (so the path executes) and reports the next readings, as fake_timer does for times."""
    power_limit_w = 700.0

    def __init__(self, readings):
        self.readings = iter(readings)

    def sustained(self, run, seconds=1.0):
        run()
        return next(self.readings)


@on_the_cpu
def test_bench_energy_columns(tmp_path):
    reading = [dict(ms=2.2, joules=0.3, watts=690.0, sm_mhz=1470), dict(ms=3.1, joules=0.6, watts=695.0, sm_mhz=1700)]
    result = harness.run_bench("tiny", CFG, [3], torch.float32, CPU, tmp_path, ("vit-triton", "timm"),
                               timer=fake_timer([1.0, 1.0, 2.0, 3.0]), log=lambda s: None, board=FixedBoard(reading))
    ours, peer = result["rows"]
    assert ours["joules_per_image"] == pytest.approx(0.1) and peer["joules_per_image"] == pytest.approx(0.2)
    assert (ours["sustained_ms"], ours["watts"], ours["sm_mhz"]) == (2.2, 690.0, 1470)
    assert result["power_limit_w"] == 700.0
    assert result["speedup"]["3"] == {"best_peer": "timm", "ours": "vit-triton", "speedup": 1.5,
                                      "energy_ratio": pytest.approx(2.0)}
    table = harness.format_table(result).splitlines()
    assert table[0].split() == ["batch", "system", "ms", "images/s", "TFLOP/s", "MFU", "peak", "GiB", "mJ/image", "W",
                                "SM", "MHz"]
    assert table[2].split()[-3:] == ["100.00", "690", "1470"]
    assert "batch 3: vit-triton is 1.50x the best peer (timm), which spends 2.00x its energy per image" in table
    assert table[-1].endswith("; power limit 700 W")


def test_energy_readings_need_a_cuda_device():
    with pytest.raises(RuntimeError, match="energy readings need a CUDA device, got cpu"):
        Board(CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVML reads a GPU board")
def test_board_reads_energy_and_clock_on_a_gpu():
    board = Board(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    replay, calls = repeated(lambda: a @ a, budget_ms=20.0)   # graph replays of ~20 ms, as --kernels --energy runs
    began = time.perf_counter()
    spent = board.sustained(replay, seconds=1.0)
    assert time.perf_counter() - began < 1.5
    assert 0 < spent["ms"] < 100 and 100 < spent["sm_mhz"] < 3000
    assert 30 < spent["watts"] <= 1.2 * board.power_limit_w
    picojoules_per_flop = spent["joules"] / (calls * 2 * 4096 ** 3) * 1e12
    assert 0.1 < picojoules_per_flop < 20   # an H100 spends about 1 pJ a bf16 FLOP


@on_the_cpu
def test_bench_refuses_to_time_a_wrong_answer(tmp_path, monkeypatch):
    def wrong_systems(*args, **kwargs):
        systems, reference, ours = build_systems(*args, **kwargs)
        with torch.no_grad():
            ours.head.bias.add_(1.0)
        return systems, reference, ours
    monkeypatch.setattr(harness, "build_systems", wrong_systems)
    timer = fake_timer(itertools.repeat(1.0))
    with pytest.raises(RuntimeError, match="output is wrong, no speed reported"):
        harness.run_bench("tiny", CFG, [1], torch.float32, CPU, tmp_path, ("vit-triton", "hf"), timer=timer,
                          log=lambda s: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert not saved["check"]["ok"] and saved["rows"] == []


@on_the_cpu
def test_a_failing_peer_is_recorded_not_fatal(tmp_path, monkeypatch):
    def failing_systems(*args, **kwargs):
        systems, reference, ours = build_systems(*args, **kwargs)
        for s in systems:
            if s.name == "timm":
                s.run = lambda px: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("no room"))
        return systems, reference, ours
    monkeypatch.setattr(harness, "build_systems", failing_systems)
    result = harness.run_bench("tiny", CFG, [1], torch.float32, CPU, tmp_path, ("vit-triton", "timm"),
                               timer=fake_timer(itertools.repeat(1.0)), log=lambda s: None)
    assert result["rows"][1] == {"system": "timm", "batch": 1, "error": "OutOfMemoryError: no room"}
    assert result["speedup"] == {}


def test_exact_fp32_timm_runs_its_matmuls_exact_in_a_tf32_run(monkeypatch):
    seen = []
    systems, _, _ = build_systems(CFG, torch.float32, CPU, ("vit-triton", "timm", "timm:exact-fp32"))
    exact = next(s for s in systems if s.name == "timm:exact-fp32")
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a, f=torch.nn.functional.linear: seen.append(torch.get_float32_matmul_precision())
                        or f(*a))
    torch.set_float32_matmul_precision("high")
    try:
        exact.run(torch.randn(1, 3, CFG.image_size, CFG.image_size))
        assert torch.get_float32_matmul_precision() == "high"   # the run's precision, restored
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen and set(seen) == {"highest"}
    skipped = build_systems(CFG, torch.bfloat16, CPU, ("vit-triton", "timm:exact-fp32"))[0]
    assert [(s.name, s.run, s.note) for s in skipped][-1] == ("timm:exact-fp32", None, "float32 runs only")


@on_the_cpu
def test_roofline_rows(tmp_path):
    cfg = PRESETS["tiny"]
    _, _, ours = build_systems(cfg, torch.float32, CPU, ("vit-triton",))
    # Ceilings of about 500 TFLOP/s (64^3 matmul) and 2 TB/s (1 MiB copy): the ridge sits at 250 FLOP/byte.
    ceiling_ms = [2 * 64 ** 3 / 5e14 * 1e3, 2 * 2 ** 20 / 2e12 * 1e3]
    result = roofline.run_roofline("tiny", cfg, 2, torch.float32, CPU, ours, tmp_path,
                                   timer=fake_timer(itertools.repeat(1e-3)), log=lambda s: None,
                                   ceiling_timer=fake_timer(ceiling_ms))
    assert (tmp_path / "roofline.png").stat().st_size > 1000
    assert json.loads((tmp_path / "roofline.json").read_text())["kernels"] == json.loads(
        json.dumps(result["kernels"]))
    rows = {r["name"]: r for r in result["kernels"]}
    ridge = result["ceilings"]["matmul_tflops"] * 1e3 / result["ceilings"]["copy_gbps"]   # FLOP / byte
    assert ridge == pytest.approx(250)
    for r in rows.values():
        assert r["intensity"] == pytest.approx(r["flops"] / r["bytes"])
        assert r["bound"] == ("compute" if r["intensity"] > ridge else "memory")
        assert r["ours_tflops"] == pytest.approx(r["flops"] / 1e-3 / 1e12 * 1e3)
    assert rows["layer_norm"]["count"] == 2 * cfg.depth and rows["layer_norm"]["bound"] == "memory"


@on_the_cpu
def test_roofline_energy_columns(tmp_path):
    cfg = PRESETS["tiny"]
    _, _, ours = build_systems(cfg, torch.float32, CPU, ("vit-triton",))
    # The ceilings' sustained runs: 2 pJ a FLOP for the 64^3 product, 10 pJ a byte for the 1 MiB copy read and
    # written; then each kernel, ours at 3 mJ a call and 600 W, PyTorch's at 5 mJ.
    ceilings = [dict(ms=1.0, joules=2e-12 * 2 * 64 ** 3, watts=700.0, sm_mhz=1500),
                dict(ms=1.0, joules=10e-12 * 2 * 2 ** 20, watts=650.0, sm_mhz=1900)]
    kernels = itertools.cycle([dict(ms=1.0, joules=3e-3, watts=600.0, sm_mhz=1600),
                               dict(ms=1.0, joules=5e-3, watts=500.0, sm_mhz=1800)])
    result = roofline.run_roofline("tiny", cfg, 3, torch.float32, CPU, ours, tmp_path,
                                   timer=fake_timer(itertools.repeat(1e-3)), log=lambda s: None,
                                   board=FixedBoard(itertools.chain(ceilings, kernels)),
                                   ceiling_timer=fake_timer([1.0, 1.0]))
    assert result["power_limit_w"] == 700.0
    assert result["energy"] == {"pj_per_flop": pytest.approx(2.0), "pj_per_byte": pytest.approx(10.0),
                                "matmul_watts": 700.0, "copy_watts": 650.0}
    for r in result["kernels"]:
        assert (r["ours_mj"], r["ours_watts"], r["ours_sm_mhz"]) == (pytest.approx(3.0), 600.0, 1600)
        assert (r["torch_mj"], r["torch_watts"], r["torch_sm_mhz"]) == (pytest.approx(5.0), 500.0, 1800)
        assert r["floor_mj"] == pytest.approx(max(2e-9 * r["flops"], 10e-9 * r["bytes"]))
    qkv = next(r for r in result["kernels"] if r["name"] == "linear qkv")
    assert qkv["floor_mj"] == pytest.approx(2e-9 * qkv["flops"])        # a product: its FLOPs set the floor
    norm = next(r for r in result["kernels"] if r["name"] == "layer_norm")
    assert norm["floor_mj"] == pytest.approx(10e-9 * norm["bytes"])     # a row kernel: its bytes do
    launches = sum(r["count"] for r in result["kernels"])
    floor = sum(r["count"] * r["floor_mj"] for r in result["kernels"]) / 3
    assert roofline.forward_energy(result) == {"ours": pytest.approx(3.0 * launches / 3),
                                               "torch": pytest.approx(5.0 * launches / 3), "floor": pytest.approx(floor)}
    table = roofline.format_roofline(result).splitlines()
    assert table[0].split()[-9:] == ["ours", "mJ", "W", "SM", "MHz", "torch", "mJ", "floor", "mJ"]
    assert table[2].split()[-5:] == ["3.00", "600", "1600", "5.00", f"{result['kernels'][0]['floor_mj']:.2f}"]
    assert table[-1] == (f"energy of one forward's kernels, each run alone for a second: ours {launches:.2f} mJ per "
                         f"image, PyTorch's {5 * launches / 3:.2f}, floor {floor:.2f} (the n^3 product 2.00 pJ/FLOP at "
                         f"700 W, the copy 10.0 pJ/byte at 650 W; power limit 700 W)")
    assert json.loads((tmp_path / "roofline.json").read_text())["energy"] == json.loads(json.dumps(result["energy"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the CLI would time")
def test_bench_cli_without_gpu(capsys):
    assert main(["bench", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device, so no timings" in out
    assert "model output against ViTForImageClassification (float64)" in out and "FAIL" not in out
    with pytest.raises(SystemExit, match="--energy reads a GPU board's energy .* needs a CUDA device"):
        main(["bench", "--energy"])
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--profile"])
    assert refused.value.code == 2 and "--profile lists the CUDA kernels" in capsys.readouterr().err


# What each of our kernels is, by its name (every @triton.jit kernel of vit_triton.kernels, so that a new one is
# classed on purpose), and names the peers' kernels take: torch.compile's, cuBLAS's, PyTorch's attention and AdamW.
OURS = {"attention": ["_attention_kernel", "_attention_backward_kernel", "_delta_kernel"],
        "GEMM": ["_linear_plain_kernel", "_linear_tma_kernel", "_linear_backward_plain_kernel",
                 "_linear_backward_tma_kernel", "_patch_embed_kernel", "_patch_embed_dweight_kernel",
                 "_patch_embed_dpixels_kernel", "_patch_embed_token_sums_kernel"],
        "norm": ["_layer_norm_kernel", "_layer_norm_backward_kernel"],
        "other": ["_codes_kernel", "_column_sums_kernel", "_grad_kernel", "_resize_pass_kernel",
                  "_resize_weights_kernel", "_round_to_tf32_kernel", "_sum_kernel", "_token_mean_kernel",
                  "_token_mean_backward_kernel", "_upsample_kernel"]}
PEERS = {"attention": ["pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>",
                       "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
                       "triton_poi_fused__scaled_dot_product_flash_attention_backward_3"],
         "GEMM": ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k",
                  "nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_NTN", "void splitKreduce_kernel<32, 16, int, float>",
                  "triton_tem_fused_addmm_gelu_1", "cutlass3x_sm90_tensorop_gemm_bf16",
                  "sm90_xmma_fprop_implicit_gemm"],
         "norm": ["triton_red_fused_add_native_layer_norm_2", "triton_per_fused_native_layer_norm_backward_7"],
         "optimizer": ["void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>"],
         "other": ["triton_poi_fused_gelu_5", "Memcpy DtoD (Device -> Device)", "Memset (Device)",
                   "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"]}


def test_kernel_classes_by_name():
    import re
    from pathlib import Path

    import vit_triton.kernels as kernels
    from vit_triton.bench.profile import CLASSES, kernel_class

    source = "".join(p.read_text() for p in Path(kernels.__file__).parent.glob("*.py"))
    ours = set(re.findall(r"@triton\.jit(?:\(.*\))?\ndef (_\w+_kernel)\(", source))
    assert ours == {name for names in OURS.values() for name in names}
    for table in (OURS, PEERS):
        assert {name: kernel_class(name) for names in table.values() for name in names} == {
            name: cls for cls, names in table.items() for name in names}
    assert set(PEERS) == set(CLASSES)


def test_format_kernel_classes():
    from vit_triton.bench.profile import CLASSES, format_kernel_classes

    def kernels(scale):
        return dict(total_us=15 * scale, launches=30, classes={c: i * scale for i, c in enumerate(CLASSES, 1)})

    rows = [dict(system="vit-triton+cudagraph", batch=64, kernels=kernels(1.0)),
            dict(system="timm+compile:reduce-overhead", batch=64, kernels=kernels(2.0)),
            dict(system="timm", batch=8, ms=1.0)]
    lines = format_kernel_classes(rows).splitlines()
    assert lines[0] == "GPU time per pass by kernel class, us (batch 64):"
    assert lines[1].split() == ["class", "vit-triton+cudagraph", "timm+compile:reduce-overhead"]
    assert [line.split() for line in lines[2:]] == [[c, f"{i:.1f}", f"{2 * i:.1f}"] for i, c in
                                                    enumerate(CLASSES, 1)] + [["total", "15.0", "30.0"],
                                                                              ["launches", "30", "30"]]


def test_own_times_leave_out_the_wait_for_the_kernel_before():
    # spans as torch.profiler gives them, out of order: b launched early waits for a, c runs alone, d lies inside c
    from vit_triton.bench.profile import own_times

    spans = [(30.0, 36.0), (0.0, 10.0), (4.0, 15.0), (31.0, 33.0), (20.0, 21.0)]
    assert own_times(spans) == [6.0, 10.0, 5.0, 0.0, 1.0]
    assert sum(own_times(spans)) == 10 + 5 + 1 + 6   # the time any of them ran
    assert own_times([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.profiler's CUDA kernels")
def test_kernel_profile_of_a_matmul_and_a_norm():
    from vit_triton.bench.profile import kernel_profile

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()   # kernels inside a replayed graph are seen too
    with torch.cuda.graph(graph):
        torch.nn.functional.layer_norm(a @ a, (2048,))
    seen = kernel_profile(graph.replay, passes=2)
    assert seen["launches"] >= 2 and seen["classes"]["GEMM"] > 0 and seen["classes"]["norm"] > 0
    assert seen["total_us"] == pytest.approx(sum(seen["classes"].values()))
    assert seen["top"][0][1] >= seen["top"][-1][1]


def test_float32_tolerance_follows_the_matmul_precision():
    # Exact float32 matmuls: the fixed 1e-5; tf32 allowed: 1.5x PyTorch's own error, as in 16-bit.
    before = torch.get_float32_matmul_precision()
    try:
        assert tolerance(torch.float32, None) == 1e-5
        torch.set_float32_matmul_precision("high")
        assert tolerance(torch.float32, 2e-4) == pytest.approx(3e-4)
        with pytest.raises(ValueError, match="PyTorch's own error"):
            tolerance(torch.float32, None)
    finally:
        torch.set_float32_matmul_precision(before)


@on_the_cpu
@pytest.mark.parametrize("timm_name, hf_class", [("vit_small_patch14_reg4_dinov2", "Dinov2WithRegistersModel"),
                                                 ("vit_base_patch16_clip_224", "CLIPVisionModel"),
                                                 ("vit_so400m_patch14_siglip_224", "SiglipVisionModel")])
def test_families_are_checked_against_their_transformers_model(timm_name, hf_class):
    """A timm architecture as bench --model builds it: transformers' model of the same family is the reference,
    and the timm architecture itself the timm peer."""
    import timm

    from vit_triton.loaders import timm_config_to_vit

    module = timm.create_model(timm_name, pretrained=False, img_size=28, patch_size=14, embed_dim=64, num_heads=2,
                               depth=1, num_classes=0)
    cfg = timm_config_to_vit(module)
    built, reference, ours = build_systems(cfg, torch.float32, CPU, ("vit-triton", "hf", "timm"), module)
    assert type(reference).__name__ == hf_class and {s.name for s in built} == {"vit-triton", "hf", "timm"}
    assert next(s for s in built if s.name == "timm").run.__class__ is type(module)
    check = harness.check_correctness(reference, ours, cfg, torch.float32, CPU, batch=2)
    assert check["ok"], check


@on_the_cpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_the_training_step_check_of_an_encoder_with_a_new_head(precision):
    """bench --train on a SigLIP encoder (no classifier: timm's new head added, as a fine-tuning run adds one): the
    first step's loss, head gradient and pixels' gradient of vit-triton within 1.5x timm's own error, both against
    timm in float32."""
    import timm

    from vit_triton.bench import train

    torch.manual_seed(0)
    module = timm.create_model("vit_base_patch16_siglip_224", pretrained=False, img_size=28, patch_size=14,
                               embed_dim=64, num_heads=2, depth=1, num_classes=0)
    assert train.with_classifier(module) is module and module.head.out_features == 1000
    reference, built = train.build_train_systems(module, precision, CPU, ("vit-triton",))
    pixels = torch.randn(3, 3, 28, 28)
    labels = torch.randint(0, 1000, (3,))
    check = train.check_step(built["vit-triton"], reference, pixels if precision == "bf16-mixed" else
                             pixels.bfloat16(), labels, precision == "bf16-mixed")
    assert check["ok"], check
