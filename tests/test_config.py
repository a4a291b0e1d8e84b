"""config.toml is complete and parses; CLI overrides behave."""

from pathlib import Path

import pytest

from mmserve.runtime.config import Config, config_from_dict, load_config, with_models

ROOT = Path(__file__).resolve().parent.parent


def test_repo_config_parses_and_matches_defaults():
    cfg = load_config(ROOT / "config.toml")
    defaults = Config()
    for section in ("server", "runtime", "limits", "encoder_cache", "prefix_cache", "generator", "supervisor", "logging", "auth"):
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert [m.name for m in cfg.models] == ["demo", "demo-wide"] and cfg.default_model == "demo"
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
