"""`vit-triton verify`, the README's main job, end to end through the interpreter."""

import pytest

from vit_triton.cli import main


def test_verify_prints_errors_and_times(capsys):
    assert main(["verify", "--dtypes", "fp32,bf16", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("patch_embed", "layer_norm final", "linear qkv", "fused_attention", "linear proj +res",
                 "linear fc1 +gelu", "linear fc2 +res", "linear head", "model forward"):
        assert out.count(name) == 2, name
    assert "FAIL" not in out
    assert "all 20 checks within tolerance" in out
    assert "time per batch of 1" in out and "images/s" in out


@pytest.mark.parametrize("args, match", [
    (["--model", "vit_huge"], "unknown model 'vit_huge'; expected one of tiny, "),
    (["--dtypes", "fp8"], "unknown dtype 'fp8'; expected a subset of fp32,bf16,fp16"),
])
def test_verify_bad_arguments(args, match):
    with pytest.raises(SystemExit, match=match):
        main(["verify", *args])


def test_bench_help_names_every_system(capsys):
    from vit_triton.bench.systems import SYSTEMS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listed = "".join(capsys.readouterr().out.split())   # argparse wraps the help text, even inside names
    assert listed.split("comma-separatedsubsetof")[1].split("(default:all)")[0].split(",") == list(SYSTEMS)
