"""scripts/cold_start.py's second new size (its timings run on the device): the nearest width whose forward shares
the tuning keys of the new size's."""

import pytest

from tests.scripts import load_script
from vit_triton.model import PRESETS

COLD_START = load_script("cold_start.py")


@pytest.mark.parametrize("model, batch", [("vit_base_patch16_224", 1), ("vit_base_patch16_224", 32),
                                          ("vit_large_patch14_clip_336", 8)])
def test_nearby_width_is_the_nearest_that_shares_the_tuning_keys(model, batch):
    config = PRESETS[model]
    patch = config.patch_size
    found = 0
    for size in range(patch * 12, patch * 33, patch):
        keys = COLD_START.tuned_sizes(config, batch, size, size)
        width = COLD_START.nearby_width(config, batch, size)
        sharing = [abs(w - size) for w in range(size - 8 * patch, size + 9 * patch, patch)
                   if w != size and COLD_START.tuned_sizes(config, batch, size, w) == keys]
        if width is None:
            assert not sharing, size
        else:
            found += 1
            assert width != size and COLD_START.tuned_sizes(config, batch, size, width) == keys
            assert abs(width - size) == min(sharing), size
    assert found >= 15, "most sizes have a nearby width that shares their tuning keys"
