"""The decode buffers' pinned staging is rewritten only after the copies that read it ran (issue
42, suspect a): a step that samples nothing transfers nothing back to order them, so each copy in
records an event and the next fill waits for it. On the CPU the copies are synchronous: no event."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.decode_graphs import DecodeBuffers


def buffers(device: str) -> DecodeBuffers:
    return DecodeBuffers(4, 3, 1, 4, scratch_slot=47, device=torch.device(device))


def test_on_the_cpu_fills_need_no_event():
    b = buffers("cpu")
    assert all(s._copied is None for s in b._sets)  # nothing to wait for on the CPU
    b.fill([5, 6], [[0, 1], [2]], [5, 2], None, 2)
    b.fill([7], [[3]], [0], None, 1)
    assert b.ids[:2].tolist() == [7, 6] and b.slots[:1].tolist() == [12]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: pinned staging, asynchronous copies")
def test_on_cuda_each_fill_waits_for_the_copies_of_the_one_before():
    b = buffers("cuda")
    for n in range(1, 40):  # fills back to back, no transfer back between them (no step samples)
        b.fill([n] * 2, [[0, 1], [2]], [n % 8, 1], None, 2)
        assert any(s._pending for s in b._sets)  # this fill's copies recorded an event on its set
    for s in b._sets:  # a fill waits only for its own set's previous copies (double-buffered)
        s.wait()
    assert not any(s._pending for s in b._sets) and b.ids[:2].tolist() == [39, 39]
