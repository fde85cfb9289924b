"""Where a piece of work's time goes on a GPU, in a few lines a bench prints with `--profile`:
host time against device time, the calls that cost the host most, the kernels that cost the
device most, and how often the host launched a kernel or waited for the device. A GPU run's
whole output then says what to change next, with no second run to look.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

#: Runtime calls that count launches and host waits.
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def profile_summary(work: Callable[[], object], title: str, rows: int = 12) -> str:
    """Runs `work()` once under torch.profiler (CPU, and CUDA where there is one) and
    summarises it."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        work()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    calls = {e.key: e.count for e in events}
    lines = [f"profile of {title}: wall {wall:.3f} s (under the profiler), device busy "
             f"{device_us / 1e6:.3f} s ({device_us / 1e6 / wall:.0%}); kernel launches "
             f"{sum(calls.get(k, 0) for k in _LAUNCHES)}, host waits and copies "
             f"{sum(calls.get(k, 0) for k in _WAITS)}"]
    lines.append("  most host time (self):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        lines.append(f"    {e.self_cpu_time_total / 1e3:9.1f} ms  {e.count:7d} calls  {e.key[:90]}")
    lines.append("  most device time (self):")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        if e.self_device_time_total:
            lines.append(f"    {e.self_device_time_total / 1e3:9.1f} ms  {e.count:7d} calls  "
                         f"{e.key[:90]}")
    return "\n".join(lines)
