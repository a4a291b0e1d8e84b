"""The CPU runtime's allocator tuning (`mmserve.runtime.host_memory`): a step's large temporaries
are not faulted in anew each time. Measured in fresh processes (the thresholds are process-wide
and this one's heap has a history): freeing a 20 MB tensor and allocating another faults its pages
in again by default; once the runtime has configured the CPU, the freed block is reused."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import torch
if sys.argv[1] == "tuned":
    from mmserve.runtime.runtime import configure_device
    configure_device("cpu")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(5 << 20).fill_(1.0)  # 20 MB, freed at once
before = faults()
for _ in range(10):
    torch.empty(5 << 20).fill_(1.0)
print((faults() - before) // 10)
"""


def faults_per_allocation(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


def test_the_cpu_runtime_keeps_freed_blocks_for_the_next_step():
    from mmserve.runtime.host_memory import keep_freed_blocks

    if not keep_freed_blocks():
        pytest.skip("not glibc: nothing to tune")
    default = faults_per_allocation("default")
    assert default > 2_000  # 20 MB of 4 KiB pages, faulted in again (measured 4,095)
    assert faults_per_allocation("tuned") * 4 < default  # measured 512
