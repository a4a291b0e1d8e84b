"""config.toml is complete and parses; every key is checked at load; CLI overrides behave."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.config import (
    Config,
    EncoderCacheConfig,
    LimitsConfig,
    ModelConfig,
    KVCacheConfig,
    SupervisorConfig,
    config_from_dict,
    load_config,
    with_models,
)

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("server", "runtime", "limits", "encoder_cache", "kv_cache", "generator", "supervisor", "logging",
            "auth", "shared_cache")


def test_repo_config_parses_and_matches_defaults():
    cfg = load_config(ROOT / "config.toml")
    defaults = Config()
    for section in SECTIONS:
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert [m.name for m in cfg.models] == ["demo", "demo-wide", "demo-qwen"] and cfg.default_model == "demo"
    assert all(m.resolved_path().is_dir() for m in cfg.models)


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="unknown key"):
        config_from_dict({"server": {"prot": 1}})
    with pytest.raises(ValueError, match="unknown section"):
        config_from_dict({"sever": {}})


def test_with_models_picks_and_orders():
    cfg = with_models(load_config(ROOT / "config.toml"), ["demo-wide"])
    assert [m.name for m in cfg.models] == ["demo-wide"] and cfg.default_model == "demo-wide"
    with pytest.raises(ValueError):
        with_models(cfg, ["no-such-model"])


# -- validation: one bad value per key ------------------------------------------------------------

INF, NAN = float("inf"), float("nan")
BAD = {  # section -> [(key, bad value), ...]: every key of every section, some more than once
    "server": [("host", ""), ("host", 5), ("port", -1), ("port", 65536), ("port", "8000"), ("port", True),
               ("max_body_bytes", 0), ("shutdown_grace_s", -1), ("shutdown_grace_s", NAN),
               ("keep_alive_timeout_s", 0), ("keep_alive_timeout_s", INF), ("body_timeout_s", 0),
               ("body_timeout_s", NAN), ("max_bodies_in_flight", 0), ("max_body_bytes_in_flight", 0),
               ("max_body_bytes_in_flight", 32 * 1024 * 1024 - 1), ("max_connections", 0),
               ("max_connections", "lots")],
    "runtime": [("device", "gpu"), ("device", "cuda:"), ("device", "cuda:x"), ("device", "CPU"), ("device", 0),
                ("dtype", "fp16"), ("torch_threads", -1), ("torch_threads", 1.5), ("max_loaded_models", -1),
                ("load_timeout_s", 0), ("load_timeout_s", "600"), ("attention_backend", "flash"),
                ("attention_backend", "Triton"), ("cuda_graphs", "yes"), ("cuda_graphs", 1),
                ("gc_freeze", "no"), ("gc_freeze", 0), ("overlap", "yes"), ("overlap", 1),
                ("deterministic", "yes"), ("deterministic", 1),
                ("graph_token_buckets", [0]), ("graph_token_buckets", 64),
                ("graph_token_buckets", [16, True]), ("graph_token_buckets", [1.5]),
                ("graph_image_buckets", [0]), ("graph_image_buckets", 8), ("graph_image_buckets", [2, True])],
    "limits": [("max_messages", 0), ("max_images_per_request", -1), ("max_image_bytes", 0),
               ("max_image_pixels", 0), ("max_image_aspect_ratio", 0.5), ("max_json_depth", 1),
               ("max_json_depth", 1001), ("image_formats", []), ("image_formats", ["png"]),
               ("image_formats", ["PNG", "SVG"]), ("image_formats", "PNG"), ("max_prompt_tokens", 0),
               ("max_tokens", 0), ("default_max_tokens", 0), ("default_max_tokens", 4097),
               ("max_stop_sequences", -1), ("decode_concurrency", 0), ("max_pending_requests", 0),
               ("request_timeout_s", 0), ("request_timeout_s", True), ("remote_images", "yes"),
               ("remote_image_hosts", "example.com"), ("remote_image_hosts", ["*"]),
               ("remote_image_allow_http", 1), ("remote_image_allow_private", 0), ("remote_image_max_bytes", -1),
               ("remote_image_timeout_s", 0), ("remote_image_max_redirects", -1),
               ("remote_image_fetch_concurrency", 0)],
    "encoder_cache": [("enabled", "true"), ("budget_bytes", -1), ("max_entries", -1), ("max_batch_images", 0),
                      ("batch_wait_ms", -1)],
    "kv_cache": [("prefix_caching", 1), ("block_size", 0), ("block_size", 4097), ("block_size", 16.0),
                 ("budget_bytes", 0), ("budget_bytes", "Auto"), ("budget_bytes", "1GiB"), ("memory_fraction", 0),
                 ("memory_fraction", 1.5), ("inflight_wait_s", -0.1), ("hash", "md5")],
    "generator": [("max_batched_tokens", 0), ("max_running_requests", 0), ("lookup_timeout_s", 0),
                  ("priority_aging_s", 0)],
    "supervisor": [("restart_backoff_s", 0), ("max_restart_backoff_s", 0.05), ("stall_timeout_s", 0),
                   ("healthy_reset_s", -1)],
    "logging": [("format", "text"), ("level", "verbose"), ("level", "INFO"), ("embedded_verbose", "yes")],
    "auth": [("api_keys", "k"), ("api_keys", [""]), ("api_keys", [" k"]), ("api_keys", [1]), ("api_keys_env", 5),
             ("admin_key", 5), ("admin_key_env", 5)],
    "shared_cache": [("url", 5), ("url", "http://127.0.0.1:6379"), ("lookup_deadline_ms", 0), ("ttl_s", 0),
                     ("write_queue", 0), ("write_batch", 0), ("backoff_s", 0), ("max_backoff_s", 0.5),
                     ("socket_timeout_s", -1), ("finish_flush_ms", -1), ("secret", 5), ("secret_file", 5),
                     ("secret_env", 5), ("trust", "everyone")],
    "models": [("name", ""), ("path", ""), ("path", "/no/such/checkpoint"), ("path", "builtin:no-such-demo"),
               ("default", "yes"), ("load", "lazy"), ("tool_parser", "mistral"), ("tool_parser", 1)],
}
CASES = [(s, k, v) for s, rows in BAD.items() for k, v in rows]
assert {s for s in BAD if s != "models"} == set(SECTIONS)
for _s in SECTIONS:  # the table covers every key
    _cls = type(getattr(Config(), _s))
    assert {k for k, _ in BAD[_s]} == {f.name for f in dataclasses.fields(_cls)}, _s
assert {k for k, _ in BAD["models"]} == {f.name for f in dataclasses.fields(ModelConfig)}


def shown(bad) -> list[str]:
    """How a bad value may appear in the message (TOML arrays arrive as tuples; a bad host entry alone)."""
    if isinstance(bad, list):
        return [repr(tuple(bad))] + [repr(x) for x in bad]
    return [repr(bad)]


@pytest.mark.parametrize(("section", "key", "bad"), CASES, ids=[f"{s}.{k}={v!r}" for s, k, v in CASES])
def test_every_key_is_checked_and_the_error_names_section_key_and_value(section, key, bad):
    if section == "models":
        raw = {"models": [{"name": "m", "path": str(ROOT), key: bad}]}
        label = "[[models]]"
    else:
        raw = {section: {key: bad}}
        label = f"[{section}]"
    with pytest.raises(ValueError) as e:
        config_from_dict(raw)
    msg = str(e.value)
    assert msg.startswith(f"config {label}"), msg
    assert f" {key}: " in msg, msg
    if (section, key) == ("shared_cache", "secret"):  # a secret is never echoed, even a malformed one
        assert repr(bad) not in msg and "got a int" in msg, msg
    else:
        assert any(s in msg for s in shown(bad)), msg
    assert "\n" not in msg


SECRET = "a-secret-of-at-least-16-bytes"


def test_a_shared_cache_without_a_secret_must_say_it_trusts_the_network():
    """A url without a secret is a config error naming both ways out; trust = "network" is the
    other. The error never echoes a secret."""
    with pytest.raises(ValueError) as e:
        config_from_dict({"shared_cache": {"url": "redis://127.0.0.1:6379/0"}})
    msg = str(e.value)
    assert msg.startswith("config [shared_cache]") and "secret" in msg and 'trust = "network"' in msg, msg
    assert "secret_file" in msg and "secret_env" in msg
    ok = config_from_dict({"shared_cache": {"url": "redis://127.0.0.1:6379/0", "trust": "network"}}).shared_cache
    assert ok.secret_bytes() is None
    assert config_from_dict({"shared_cache": {"trust": "secret"}}).shared_cache.secret_bytes() is None  # off: fine
    with_secret = config_from_dict({"shared_cache": {"url": "redis://h:1/0", "secret": SECRET}}).shared_cache
    assert with_secret.secret_bytes() == SECRET.encode() and SECRET not in repr(with_secret)
    with pytest.raises(ValueError) as e:
        config_from_dict({"shared_cache": {"url": "redis://h:1/0", "secret": "short-secret"}})
    assert "at least 16 bytes" in str(e.value) and "short-secret" not in str(e.value)
    with pytest.raises(ValueError, match="at most one of secret, secret_file and secret_env"):
        config_from_dict({"shared_cache": {"secret": SECRET, "secret_env": "X"}})


def test_the_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    url = "redis://127.0.0.1:6379/0"
    assert config_from_dict({"shared_cache": {"url": url, "secret_file": str(path)}}).shared_cache.secret_bytes() \
        == SECRET.encode()
    with pytest.raises(ValueError, match="secret_file: cannot read"):
        config_from_dict({"shared_cache": {"url": url, "secret_file": str(tmp_path / "absent")}})
    monkeypatch.delenv("MMSERVE_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match="'MMSERVE_TEST_SECRET' is not set"):
        config_from_dict({"shared_cache": {"url": url, "secret_env": "MMSERVE_TEST_SECRET"}})
    monkeypatch.setenv("MMSERVE_TEST_SECRET", SECRET)
    config = config_from_dict({"shared_cache": {"url": url, "secret_env": "MMSERVE_TEST_SECRET"}})
    assert config.shared_cache.secret_bytes() == SECRET.encode()


def test_message_format():
    with pytest.raises(ValueError) as e:
        config_from_dict({"kv_cache": {"block_size": 0}})
    assert str(e.value) == "config [kv_cache] block_size: must be an integer from 1 to 4096, got 0"
    with pytest.raises(ValueError) as e:
        config_from_dict({"limits": {"max_tokens": 100, "default_max_tokens": 200}})
    assert str(e.value) == "config [limits] default_max_tokens: must be an integer from 1 to max_tokens (100), got 200"
    with pytest.raises(ValueError) as e:
        config_from_dict({"runtime": {"device": "gpu"}})
    assert str(e.value) == "config [runtime] device: must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'gpu'"


@pytest.mark.parametrize("raw", [
    {"server": {"port": 0, "host": "0.0.0.0", "shutdown_grace_s": 0, "keep_alive_timeout_s": 1}},
    {"server": {"body_timeout_s": 0.5, "max_bodies_in_flight": 1, "max_body_bytes": 10,
                "max_body_bytes_in_flight": 10}},
    {"runtime": {"device": "cuda:1", "dtype": "bfloat16", "torch_threads": 2, "max_loaded_models": 1,
                 "load_timeout_s": 0.5}},
    {"runtime": {"device": "mps", "dtype": "float16"}},
    {"runtime": {"device": "cuda"}},
    {"runtime": {"attention_backend": "triton", "cuda_graphs": False, "gc_freeze": False}},
    {"limits": {"max_images_per_request": 0, "max_stop_sequences": 0, "max_image_aspect_ratio": 1,
                "max_json_depth": 2, "image_formats": ["GIF", "BMP", "TIFF", "PNG", "JPEG", "WEBP"],
                "max_tokens": 8, "default_max_tokens": 8, "request_timeout_s": 0.3}},
    {"encoder_cache": {"budget_bytes": 0, "max_entries": 3, "batch_wait_ms": 0, "max_batch_images": 1}},
    {"kv_cache": {"block_size": 1, "budget_bytes": 1, "inflight_wait_s": 0, "hash": "sha256"}},
    {"kv_cache": {"block_size": 4096, "prefix_caching": False}},
    {"kv_cache": {"budget_bytes": "auto", "memory_fraction": 1.0}},
    {"runtime": {"dtype": "auto"}},
    {"generator": {"max_batched_tokens": 1, "max_running_requests": 1, "lookup_timeout_s": 0.3,
                   "priority_aging_s": 0.5}},
    {"supervisor": {"restart_backoff_s": 0.02, "max_restart_backoff_s": 0.02, "stall_timeout_s": 0.5,
                    "healthy_reset_s": 1}},
    {"logging": {"format": "console", "level": "debug"}},
    {"auth": {"api_keys": ["k1", "k2"], "admin_key": "root", "api_keys_env": "", "admin_key_env": ""}},
    {"models": [{"name": "m", "path": str(ROOT), "load": "on_demand"}, {"name": "d", "path": "builtin:demo-wide"}]},
])
def test_unusual_but_valid_values_are_accepted(raw):
    config_from_dict(raw)


def test_replace_and_direct_construction_check_too():
    with pytest.raises(ValueError, match=r"config \[kv_cache\] block_size: .* got 0"):
        Config().replace(kv_cache={"block_size": 0})
    with pytest.raises(ValueError, match=r"config \[supervisor\] max_restart_backoff_s"):
        Config().replace(supervisor={"restart_backoff_s": 10.0})
    with pytest.raises(ValueError, match=r"config \[encoder_cache\] budget_bytes"):
        EncoderCacheConfig(budget_bytes=-1)
    with pytest.raises(ValueError, match=r"config \[kv_cache\] block_size"):
        KVCacheConfig(block_size=True)
    with pytest.raises(ValueError, match=r"config \[server\]: must be a ServerConfig"):
        Config(server={"port": 1})
    c = Config().replace(kv_cache={"block_size": 8, "budget_bytes": 1}, encoder_cache={"max_entries": 3},
                         supervisor={"stall_timeout_s": 0.5, "restart_backoff_s": 0.02})
    assert c.kv_cache.block_size == 8 and c.supervisor.restart_backoff_s == 0.02
    assert LimitsConfig(image_formats=["PNG"]).image_formats == ("PNG",)  # lists stored as tuples
    assert SupervisorConfig(restart_backoff_s=1, max_restart_backoff_s=1).max_restart_backoff_s == 1


def test_model_paths_are_checked_when_loading_a_config_file(tmp_path):
    missing = ModelConfig("x", str(tmp_path / "missing"))  # built in code: constructible (the registry reports it)
    assert Config(models=(missing,)).models == (missing,)
    path = tmp_path / "c.toml"
    path.write_text('[[models]]\nname = "mine"\npath = "ckpt"\n')
    with pytest.raises(ValueError) as e:
        load_config(path)
    assert str(e.value) == (f"config [[models]] 'mine' path: must be an existing checkpoint directory, "
                            f"got {str(tmp_path / 'ckpt')!r}")
    (tmp_path / "ckpt").mkdir()
    assert load_config(path).models[0].path == str(tmp_path / "ckpt")  # relative: against the file's directory
    with pytest.raises(ValueError, match=r"'builtin:demo', 'builtin:demo-qwen', 'builtin:demo-wide', got 'builtin:tiny'"):
        config_from_dict({"models": [{"name": "t", "path": "builtin:tiny"}]})


@pytest.mark.parametrize(("raw", "match"), [
    ({"models": []}, r"config \[\[models\]\]: is empty"),
    ({"models": [{"name": "a", "path": "builtin:demo"}, {"name": "a", "path": "builtin:demo-wide"}]},
     r"config \[\[models\]\] name: must be unique across models, got \['a'\]"),
    ({"models": [{"name": "a", "path": "builtin:demo", "default": True},
                 {"name": "b", "path": "builtin:demo-wide", "default": True}]},
     r"config \[\[models\]\] default: must be true for at most one model, got \['a', 'b'\]"),
    ({"models": [{"name": "a"}]}, r"config \[\[models\]\]: missing key\(s\) \['path'\]"),
    ({"models": {"name": "a"}}, r"config \[\[models\]\]: must be an array of tables"),
    ({"server": 3}, r"config \[server\]: must be a table, got 3"),
])
def test_model_list_and_table_shapes(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[server\nport = 1\n")
    with pytest.raises(ValueError, match=r"config .*c\.toml: not valid TOML"):
        load_config(path)


# -- the CLI ---------------------------------------------------------------------------------------


def serve_bad_config(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[kv_cache]\nblock_size = 0\n")
    return subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_serve_refuses_a_bad_config(tmp_path):
    proc = serve_bad_config(tmp_path)
    assert proc.returncode == 1
    assert "config [kv_cache] block_size: must be an integer from 1 to 4096, got 0" in proc.stderr


def test_cli_serve_reports_a_bad_config_in_one_line(tmp_path):
    proc = serve_bad_config(tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "config [kv_cache] block_size: must be an integer from 1 to 4096, got 0" in lines[0]


def test_the_old_prefix_cache_section_still_works_with_a_deprecation_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"\[prefix_cache\] is deprecated.*prefix_caching \(was enabled\)"):
        c = config_from_dict({"prefix_cache": {"enabled": False, "block_size": 8, "budget_bytes": 1 << 20}})
    assert (c.kv_cache.prefix_caching, c.kv_cache.block_size, c.kv_cache.budget_bytes) == (False, 8, 1 << 20)
    with pytest.warns(DeprecationWarning):
        assert Config().replace(prefix_cache={"block_size": 32}).kv_cache.block_size == 32
    with pytest.raises(ValueError, match="unknown key"):
        config_from_dict({"prefix_cache": {"slots": 3}})


def test_attention_backend_choices_are_the_attention_packages():
    from mmserve.engine.attention import NAMES
    from mmserve.config.checks import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == NAMES
