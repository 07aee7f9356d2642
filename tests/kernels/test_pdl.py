"""The launch mode for programmatic dependent launch: early when a launch's programs all fit on the
SMs, late when they do not, off without a Hopper GPU, under the interpreter or with VIT_TRITON_PDL=0."""

import pytest
import torch

from vit_triton.kernels import common
from vit_triton.kernels.common import PDL_EARLY, PDL_LATE, PDL_OFF, pdl

HOPPER = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU of 132 SMs as far as pdl() can tell, on a machine that has none."""
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "gdc_wait", object())
    monkeypatch.setattr(common, "_pdl_supported", lambda index: True)
    monkeypatch.setattr(common, "_sm_count", lambda index: 132)
    monkeypatch.delenv("VIT_TRITON_PDL", raising=False)


@pytest.mark.parametrize("programs, mode", [(1, PDL_EARLY), (131, PDL_EARLY), (132, PDL_EARLY), (133, PDL_LATE),
                                            (50_000, PDL_LATE)])
def test_early_only_when_every_program_fits(hopper, programs, mode):
    assert pdl(HOPPER, programs) == {"PDL": mode, "launch_pdl": True}


def test_off_when_disabled_or_unsupported(hopper, monkeypatch):
    monkeypatch.setenv("VIT_TRITON_PDL", "0")
    assert pdl(HOPPER, 1) == {"PDL": PDL_OFF}
    monkeypatch.delenv("VIT_TRITON_PDL")
    monkeypatch.setattr(common, "_pdl_supported", lambda index: False)   # before Hopper
    assert pdl(HOPPER, 1) == {"PDL": PDL_OFF}


def test_off_on_the_cpu():
    assert pdl(torch.device("cpu"), 1) == {"PDL": PDL_OFF}
