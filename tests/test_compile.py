"""Every kernel compiles for the H100 (sm_90); its matrix products use Hopper's wgmma, and linear's
descriptor path the TMA."""

import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90_with_wgmma():
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=script.parent.parent)
    assert result.returncode == 0, result.stderr[-5000:]
    counts = {}
    for line in result.stdout.splitlines():
        name, dtype, wgmma, tma = line.rsplit(" ", 3)
        counts.setdefault((name, dtype), []).append((int(wgmma.removeprefix("wgmma=")), int(tma.removeprefix("tma="))))
    assert len(counts) == 21, sorted(counts)
    for (name, dtype), found in counts.items():
        # Tensor-core kernels in 16-bit and tf32 must use wgmma; exact fp32 and row kernels none.
        uses_tensor_cores = name.startswith(("linear", "fused_attention", "patch_embed")) and dtype != "fp32"
        assert all(w > 0 for w, _ in found) if uses_tensor_cores else all(w == 0 for w, _ in found), (name, dtype, found)
        # The descriptor path of linear moves its tiles with the TMA (bulk tensor copies); no other does.
        assert all((t > 0) == (name == "linear-tma") for _, t in found), (name, dtype, found)
