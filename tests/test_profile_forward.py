"""scripts/profile_forward.py's command line on a machine without a GPU (its timings run on the device)."""

from tests.scripts import run_script


def test_bad_batch_sizes_are_named():
    for value in ("1,x", "0", "8,,32"):
        result = run_script("profile_forward.py", "--batch-sizes", value)
        assert result.returncode == 2, result.stderr
        assert f"argument --batch-sizes: expected comma-separated positive integers, got '{value}'" in result.stderr, result.stderr
