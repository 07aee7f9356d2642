"""`python -m vit_triton ...` (and `torchrun ... -m vit_triton embed ...`): the vit-triton command."""

from .cli import run

run()
