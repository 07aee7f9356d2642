"""Running a script of scripts/ as a user would, from the repository root."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """python scripts/<name> args..., its output captured as text."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          cwd=ROOT)
