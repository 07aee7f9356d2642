"""What a system costs the board: energy per call, mean power and SM clock over a sustained run, from
NVML (NVIDIA's management library, through nvidia-ml-py).

At large batch a ViT forward holds an H100 at its power limit (700 W on the SXM board): the driver lowers
the SM clock until the power fits, so images per second are that limit over joules per image, and a kernel
made faster without spending less energy gains little there.
`vit-triton bench --energy` measures this beside each timing: the system runs back to back for about a
second while a thread reads the board's energy counter (millijoules since the driver loaded) every
millisecond and the SM clock every ten.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ..utils import require

QUEUED_CALLS = 3


class Board:
    """The NVML handle of one CUDA device (matched by UUID, so CUDA_VISIBLE_DEVICES does not matter)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"energy readings need a CUDA device, got {device}")
        pynvml = require("pynvml", "bench", "--energy (board energy from NVML)")
        try:
            pynvml.nvmlInit()
            uuid = torch.cuda.get_device_properties(device).uuid
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000
        except pynvml.NVMLError as e:
            raise RuntimeError(f"energy readings need NVML (the NVIDIA driver's library): {e}") from e
        self._nvml = pynvml

    def energy_mj(self) -> int:
        """Millijoules the board has used since the driver loaded."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def sm_mhz(self) -> int:
        return self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)

    def sustained(self, run: Callable[[], object], seconds: float = 1.0) -> dict:
        """run() called back to back for `seconds` (then until the GPU is done): ms and joules a call, mean
        board power (W) and median SM clock (MHz) over that span.

        The driver advances the energy counter in steps (100 ms apart on an H100), so a difference of two
        reads over a second would be off by up to a tenth. A thread polls the counter every millisecond, and
        the power is the slope between the first and the last step seen during the run. At most QUEUED_CALLS
        calls wait on the GPU, so the run ends about `seconds` after it starts, however deep the driver's
        launch queue."""
        steps, clocks, done = [], [], threading.Event()

        def sample() -> None:
            polls = 0
            while not done.wait(0.001):
                energy = self.energy_mj()
                if not steps or energy != steps[-1][1]:
                    steps.append((time.perf_counter(), energy))
                if polls % 10 == 0:
                    clocks.append(self.sm_mhz())
                polls += 1

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        torch.cuda.synchronize()
        calls, start, queued = 0, time.perf_counter(), collections.deque()
        while time.perf_counter() - start < seconds:
            run()
            calls += 1
            queued.append(torch.cuda.Event())
            queued[-1].record()
            if len(queued) > QUEUED_CALLS:
                queued.popleft().synchronize()
        torch.cuda.synchronize()
        end = time.perf_counter()
        done.set()
        sampler.join()
        inside = [(t, e) for t, e in steps[1:] if start <= t <= end]   # steps[0]: the counter as first read
        if len(inside) < 2:
            raise RuntimeError(f"the board's energy counter moved {len(inside)} times in {end - start:.2f} s; "
                               "measure over more seconds")
        (t0, e0), (t1, e1) = inside[0], inside[-1]
        watts = (e1 - e0) / 1000 / (t1 - t0)
        ms = 1000 * (end - start) / calls
        return dict(ms=ms, joules=watts * ms / 1000, watts=watts, sm_mhz=statistics.median(clocks or [self.sm_mhz()]))
