"""The launchers' host-side integer helpers, against Triton's own (which cost microseconds a call in Triton 3.8)."""

import triton

from vit_triton.kernels.common import cdiv, next_power_of_2


def test_host_cdiv_and_next_power_of_2_are_tritons():
    sizes = [*range(0, 300), 1023, 1024, 1025, 50_176, 2**31 - 1, 2**31, 2**40 + 3]
    for a in sizes:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 197, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
