"""`[runtime] gc_freeze`: a loaded model's objects are out of the garbage collector's full walks
(each ~200 ms over a loaded model's heap, on the event loop's thread), and nothing is kept alive by
it: an unloaded model is collected, a closed Runtime leaves nothing frozen."""

from __future__ import annotations

import gc
import weakref

import pytest
import trio

from mmserve import Runtime
from mmserve.runtime import gc_heap


@pytest.fixture
def gc_freeze(_gc_freeze_only_where_asked, monkeypatch):
    """The real `gc_heap.settle` (conftest skips it for the rest of the suite)."""
    monkeypatch.setattr(gc_heap, "settle", _gc_freeze_only_where_asked)
    gc.unfreeze()


async def test_a_loaded_model_is_frozen_and_a_closed_runtime_releases_it(tiny_config, gc_freeze):
    async with Runtime.open(tiny_config) as rt:
        assert rt.config.runtime.gc_freeze  # the default
        # the model's modules and everything alive at the load are in the permanent generation now
        frozen = gc.get_freeze_count()
        assert frozen > 10_000
        model = rt.registry.loaded["tiny"].adapter.model
        assert all(o is not model for o in gc.get_objects())  # the collector's generations skip it
        answer = await rt.chat_completion([{"role": "user", "content": "Hello"}], max_tokens=3)
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert gc.get_freeze_count() > frozen * 0.9  # serving does not thaw it (a few frozen objects die)
    assert gc.get_freeze_count() == 0


async def test_an_unloaded_model_is_collected(tiny_config, gc_freeze):
    """Unloading thaws the heap: the model's own reference cycles (a frozen cycle is never
    collected) go with the next collection, not with the next load."""
    async with Runtime.open(tiny_config) as rt:
        await rt.chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2)
        model = weakref.ref(rt.registry.loaded["tiny"].adapter.model)
        assert gc.get_freeze_count() > 0
        rt.registry.unload("tiny")
        assert gc.get_freeze_count() == 0
        for _ in range(50):  # the unloaded model's actor tasks end at their next checkpoint
            await trio.sleep(0.02)
            gc.collect()
            if model() is None:
                break
        assert model() is None


async def test_off_leaves_the_collector_alone(tiny_config, gc_freeze):
    async with Runtime.open(tiny_config.replace(runtime={"gc_freeze": False})):
        assert gc.get_freeze_count() == 0
