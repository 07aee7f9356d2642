"""`python -m vit_triton ...` (and `torchrun ... -m vit_triton embed ...`): the vit-triton command."""

import sys

from .cli import main

sys.exit(main())
