"""The packaged default config (`Runtime.open()`'s) is the repository's config.toml, byte for byte:
one text a user reads, copies and edits, one set of defaults an embedded program gets. (Running
`Runtime.open()` from another directory: tests/test_embedded_logging.py.)"""

import tomllib
from pathlib import Path

from mmserve.config import load_config
from mmserve.runtime.runtime import DEFAULT_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def test_the_packaged_default_config_is_config_toml():
    assert DEFAULT_CONFIG.read_bytes() == (ROOT / "config.toml").read_bytes(), (
        "config.toml and mmserve/config/default.toml differ: edit config.toml, then "
        "`cp config.toml mmserve/config/default.toml`")


def test_the_packaged_default_config_ships_and_names_only_packaged_checkpoints():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert DEFAULT_CONFIG.name in package_data["mmserve.config"]
    assert DEFAULT_CONFIG.parent == ROOT / "mmserve" / "config"
    config = load_config(DEFAULT_CONFIG)
    assert config.default_model == "demo"
    for m in config.models:  # builtin:NAME resolves inside the package, whatever the working directory
        assert m.path.startswith("builtin:") and m.resolved_path().is_dir(), m
