"""SyncRuntime offers what Runtime offers, and one model's health means the same embedded and over
HTTP (issue 44)."""

from __future__ import annotations

import inspect

import httpx
import trio

from mmserve import Runtime, SyncRuntime
from mmserve.config import ModelConfig
from tests.helpers import colour_question

# Runtime's own that are not calls on a running runtime: `open` is what SyncRuntime's
# constructor and `start`/`with` do
NOT_CALLS = {"open"}


def _public_methods(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, callable)
            if not name.startswith("_") and name not in NOT_CALLS}


def test_sync_runtime_has_every_public_method_of_runtime_with_its_parameters():
    ours, theirs = _public_methods(SyncRuntime), _public_methods(Runtime)
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"SyncRuntime lacks {missing}"
    for name, sig in theirs.items():  # each parameter taken by name, or passed on through **kwargs
        mine = ours[name].parameters
        passes_on = any(p.kind is p.VAR_KEYWORD for p in mine.values())
        for param in sig.parameters.values():
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                assert param.name in mine or passes_on, f"SyncRuntime.{name} lacks {param.name}"


def test_sync_runtime_calls_each_of_them(tiny_config, tiny_model_dir):
    config = tiny_config.replace(models=(*tiny_config.models, ModelConfig("lazy", str(tiny_model_dir))))
    with SyncRuntime(config) as rt:
        assert [m["name"] for m in rt.models()] == ["tiny", "lazy"]
        assert rt.text_completion("Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2
        assert rt.chat_completion(colour_question("red"), max_tokens=2).usage.completion_tokens == 2
        assert "tiny" in rt.stats() and "tiny" in rt.debug_cache()
        assert set(rt.reset_caches()["tiny"]) == {"encoder", "prefix"}
        assert rt.parse({"messages": [{"role": "user", "content": "hi"}]}).model == "tiny"
        assert len(rt.parse_completions({"prompt": ["a", "b"]})) == 2
        # a configured model that is not loaded: not ok, as GET /health?model= answers 503
        lazy = rt.health("lazy")
        assert not lazy.ok and not lazy.serving and lazy.state == "not_loaded" and "not loaded" in lazy.reason
        assert rt.health().ok and rt.health("tiny").ok
        rt.drain(0)
        assert not rt.health().ok


def test_health_of_one_model_is_the_same_embedded_and_over_http(tiny_config, tiny_model_dir):
    from tests.helpers import ServerThread

    config = tiny_config.replace(models=(*tiny_config.models, ModelConfig("lazy", str(tiny_model_dir))))
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        rt = server.runtime
        for name in ("tiny", "lazy"):
            embedded = trio.from_thread.run_sync(rt.health, name, trio_token=server._token)
            over_http = client.get("/health", params={"model": name})
            assert (over_http.status_code == 200) == embedded.ok, name
        assert client.get("/health", params={"model": "lazy"}).headers.get("retry-after") is None
