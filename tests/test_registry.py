"""Multi-model registry: on-demand loading, LRU unloading of idle models, /v1/models."""

import pytest
import trio

from mmserve import Runtime
from mmserve.errors import ModelNotFound
from mmserve.models.demo import build_untrained
from mmserve.config import Config, ModelConfig
from tests.helpers import colour_question


@pytest.fixture(scope="module")
def three_models(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("models")
    b = build_untrained("tiny", root / "b", seed=1)
    c = build_untrained("tiny", root / "c", seed=2)
    return tiny_model_dir, b, c


def config(paths, **runtime):
    a, b, c = paths
    return Config(models=(ModelConfig("a", str(a), default=True), ModelConfig("b", str(b)),
                          ModelConfig("c", str(c), load="eager"))).replace(runtime=runtime)


async def ask(rt, model):
    return await rt.chat_completion(colour_question("red"), model=model, max_tokens=2, temperature=0)


async def test_default_and_eager_models_load_at_start_others_on_first_use(three_models):
    async with Runtime.open(config(three_models)) as rt:
        assert {m["name"]: m["loaded"] for m in rt.models()} == {"a": True, "b": False, "c": True}
        async with trio.open_nursery() as n:  # concurrent first requests share one load
            for _ in range(3):
                n.start_soon(ask, rt, "b")
        assert set(rt.registry.loaded) == {"a", "b", "c"}
        assert set(rt.supervisor.states) >= {"encoder[b]", "generator[b]"}
        with pytest.raises(ModelNotFound):
            rt.chat(colour_question("red"), model="zzz")


async def test_least_recently_used_idle_model_is_unloaded(three_models):
    async with Runtime.open(config(three_models, max_loaded_models=2)) as rt:
        assert set(rt.registry.loaded) == {"a", "c"}
        await ask(rt, "a")  # c is now the least recently used
        await ask(rt, "b")
        assert set(rt.registry.loaded) == {"a", "b"}
        assert "generator[c]" not in rt.supervisor.states and rt.health().ok
        await ask(rt, "c")
        assert set(rt.registry.loaded) == {"b", "c"}
