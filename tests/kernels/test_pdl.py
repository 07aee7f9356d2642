"""The launch mode for programmatic dependent launch: early when a launch's programs all fit on the
SMs, late when they do not, off without a Hopper GPU, under the interpreter or in launch_options(pdl=False)."""

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


@pytest.mark.parametrize("programs, mode", [(1, PDL_EARLY), (131, PDL_EARLY), (132, PDL_EARLY), (133, PDL_LATE),
                                            (50_000, PDL_LATE)])
def test_early_only_when_every_program_fits(hopper, programs, mode):
    assert pdl(HOPPER, programs) == {"PDL": mode, "launch_pdl": True}


def test_off_when_disabled_or_unsupported(hopper, monkeypatch):
    with common.launch_options(pdl=False):
        assert pdl(HOPPER, 1) == {"PDL": PDL_OFF}
    assert pdl(HOPPER, 1) == {"PDL": PDL_EARLY, "launch_pdl": True}
    monkeypatch.setattr(common, "_pdl_supported", lambda index: False)   # before Hopper
    assert pdl(HOPPER, 1) == {"PDL": PDL_OFF}


def test_off_on_the_cpu():
    assert pdl(torch.device("cpu"), 1) == {"PDL": PDL_OFF}


def test_launch_options_nest_stay_in_their_thread_and_name_what_they_do_not_know():
    import threading

    from vit_triton.kernels import LaunchOptions, current_launch_options, launch_options

    assert current_launch_options() == LaunchOptions(pdl=True, tf32_copies=True)
    seen = []
    with launch_options(pdl=False):
        with launch_options(tf32_copies=False) as inner:
            assert inner == current_launch_options() == LaunchOptions(pdl=False, tf32_copies=False)
            other = threading.Thread(target=lambda: seen.append(current_launch_options()))
            other.start()
            other.join()
        assert current_launch_options() == LaunchOptions(pdl=False, tf32_copies=True)
    assert current_launch_options() == LaunchOptions() and seen == [LaunchOptions()]
    with pytest.raises(TypeError, match="pdll"):
        with launch_options(pdll=False):
            pass
