import resource

import pytest
import torch

from tokenmill.host_memory import keep_freed_memory


def test_freed_step_buffers_are_reused_without_page_faults():
    if not keep_freed_memory():
        pytest.skip("no glibc mallopt here")
    for _ in range(10):  # warm-up: the heap grows until freed buffers fit the next request
        torch.ones(4 << 20)  # 16 MiB, above glibc's default mmap threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(4 << 20)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # 10 fresh 16 MiB buffers would fault in ~40,000 pages
    assert faults < 1000
