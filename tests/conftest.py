"""Runs every kernel through Triton's interpreter on machines without a CUDA device.

TRITON_INTERPRET must be set before triton is imported, which conftest.py precedes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
