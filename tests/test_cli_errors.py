"""`mmserve serve` stops with one line on stderr, no traceback and a non-zero status, for the
mistakes a new user makes first: a directory that is not a checkpoint, a checkpoint of a family
mmserve does not serve, a port already in use. The embedded Runtime (and `api.server.serve`)
raise the same typed errors with the same messages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from mmserve import Runtime
from mmserve.api.server import serve
from mmserve.config import Config, ModelConfig
from mmserve.errors import CannotListen, CheckpointError, NotACheckpoint, ServiceUnavailable, UnsupportedModelType
from mmserve.models.loading import FAMILIES
from tests.helpers import colour_question

ROOT = Path(__file__).resolve().parent.parent


def serve_cli(*args: str) -> tuple[int, list[str]]:
    """Runs `mmserve serve ARGS` to its end: its exit status and its stderr's lines."""
    proc = subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stderr.strip().splitlines()


def the_one_line(status: int, lines: list[str]) -> str:
    assert status == 1, lines
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("mmserve serve: ") and "Traceback" not in lines[0]
    return lines[0].removeprefix("mmserve serve: ")


def names_every_served_family(line: str) -> None:
    assert all(kind in line for kind in FAMILIES), line  # llava, qwen2_vl


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a model")
    return tmp_path / "notes"


@pytest.fixture
def whisper_dir(tmp_path) -> Path:
    path = tmp_path / "whisper-tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "whisper", "d_model": 384}))
    return path


def test_a_directory_that_is_not_a_checkpoint(empty_dir):
    line = the_one_line(*serve_cli("--model", str(empty_dir), "--port", "0"))
    assert line.startswith(f"model 'notes': {empty_dir} is not a checkpoint: it has no config.json"), line
    names_every_served_family(line)


def test_a_checkpoint_whose_model_type_is_not_served(whisper_dir):
    line = the_one_line(*serve_cli("--model", str(whisper_dir), "--port", "0"))
    assert "model_type 'whisper' is not served by mmserve" in line
    names_every_served_family(line)


@pytest.mark.slow  # a process start (~4 s); in process: test_a_model_loaded_on_demand_fails_its_request_with_a_503
def test_a_model_in_the_config_is_checked_even_when_it_loads_on_demand(tmp_path, whisper_dir):
    config = tmp_path / "config.toml"
    config.write_text(f'[[models]]\nname = "demo"\npath = "builtin:demo"\ndefault = true\n\n'
                      f'[[models]]\nname = "speech"\npath = "{whisper_dir}"\nload = "on_demand"\n')
    line = the_one_line(*serve_cli("--config", str(config), "--port", "0"))
    assert line.startswith("model 'speech': model_type 'whisper' is not served"), line


def test_a_config_json_that_is_not_json(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{model_type: llava")
    line = the_one_line(*serve_cli("--model", str(tmp_path / "broken"), "--port", "0"))
    assert "config.json cannot be read as JSON" in line


def test_a_port_already_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = the_one_line(*serve_cli("--model", "demo", "--port", str(port)))
    assert line == (f"cannot listen on 127.0.0.1:{port}: the address is already in use (another server on port "
                    f"{port}?); choose another port with --port or [server] port, or 0 for a free one")


# -- the same errors, embedded -----------------------------------------------------------------------


def one_model(path: Path, **kw) -> Config:
    return Config().replace(models=(ModelConfig(path.name, str(path), default=True, **kw),))


async def test_runtime_open_raises_the_same_message(empty_dir, whisper_dir):
    with pytest.raises(NotACheckpoint) as not_one:
        async with Runtime.open(one_model(empty_dir)):
            pass
    assert not_one.value.message == the_one_line(*serve_cli("--model", str(empty_dir), "--port", "0"))
    with pytest.raises(UnsupportedModelType, match="model_type 'whisper' is not served by mmserve"):
        async with Runtime.open(one_model(whisper_dir)):
            pass


async def test_a_model_loaded_on_demand_fails_its_request_with_a_503(tiny_config, whisper_dir):
    config = tiny_config.replace(models=(*tiny_config.models, ModelConfig("speech", str(whisper_dir), load="on_demand")))
    async with Runtime.open(config) as rt:
        with pytest.raises(UnsupportedModelType) as refused:
            await rt.chat_completion(colour_question("red"), model="speech", max_tokens=2)
        assert isinstance(refused.value, ServiceUnavailable) and refused.value.status == 503
        assert refused.value.code == CheckpointError.code
        assert {m["name"]: m["state"] for m in rt.models()}["speech"] == "failed"


async def test_serve_refuses_a_taken_port_before_loading_any_model(tiny_config):
    opened = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{port}: the address is already in use"):
            with trio.fail_after(10):
                await serve(tiny_config.replace(server={"port": port}), on_runtime=opened.append)
    assert opened == []  # refused before the Runtime opened: no model was loaded for nothing
