"""An embedded runtime's logs are the host program's: through `logging` (logger `mmserve`), by
default only warnings and errors to stderr (every event at `[logging] level`, in its format, with
`embedded_verbose = true`), never to stdout; a host's own `logging`
configuration governs them. And `Runtime.open()` / `SyncRuntime()` with no argument serve the
packaged default config from any working directory (tests/test_default_config.py pins the file).

Each case is a tiny program run as its own process, from a temporary directory (not the repo)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEADER = """
import logging, sys, trio, mmserve
from mmserve.models.demo import render_image

messages = [{"role": "user", "content": [
    {"type": "image", "image": render_image("purple", "circle")},
    {"type": "text", "text": "What color is the shape?"}]}]
"""

PROGRAMS = {
    # Runtime.open() with no argument: the packaged default config, [logging] json / info
    "default": """
async def main():
    async with mmserve.Runtime.open() as rt:
        print((await rt.chat_completion(messages, temperature=0, max_tokens=8)).text)
trio.run(main)
""",
    # a config file asking for console format at debug level
    "configured": """
async def main():
    async with mmserve.Runtime.open(sys.argv[1]) as rt:
        print((await rt.chat_completion(messages, temperature=0, max_tokens=8)).text)
trio.run(main)
""",
    # the host sets the mmserve logger's level; the sync facade
    "host_level": """
logging.getLogger("mmserve").setLevel(logging.WARNING)
with mmserve.SyncRuntime() as rt:
    print(rt.chat_completion(messages, temperature=0, max_tokens=8).text)
""",
    # the host configures the root logger: its handler prints mmserve's events, once each
    "host_root": """
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="HOST %(levelname)s %(name)s %(message)s")
async def main():
    async with mmserve.Runtime.open() as rt:
        print((await rt.chat_completion(messages, temperature=0, max_tokens=8)).text)
trio.run(main)
""",
}

CONFIGURED = """
[logging]
format = "console"
level = "debug"
embedded_verbose = true

[[models]]
name = "demo"
path = "builtin:demo"
"""


def _run_all(tmp_path: Path) -> dict[str, subprocess.CompletedProcess]:
    """Runs every program at once (each is mostly start-up), each in its own temp directory."""
    procs = {}
    for name, body in PROGRAMS.items():
        cwd = tmp_path / name
        cwd.mkdir()
        (cwd / "prog.py").write_text(textwrap.dedent(HEADER) + textwrap.dedent(body))
        args = [sys.executable, "prog.py"]
        if name == "configured":
            (cwd / "my.toml").write_text(CONFIGURED)
            args.append("my.toml")
        procs[name] = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        assert p.returncode == 0, (name, stderr[-3000:])
    return out


def test_embedded_logs_go_to_stderr_and_follow_the_host(tmp_path):
    runs = _run_all(tmp_path)

    # stdout is the program's alone, whatever the logging set-up
    for name, run in runs.items():
        assert run.stdout == "purple\n", (name, run.stdout[:2000])

    # default: quiet, as a library is (warnings and errors only; none in a run that goes well)
    events = [json.loads(line) for line in runs["default"].stderr.splitlines()]
    assert all(e["level"] in ("warning", "error") for e in events), events[:5]
    assert "runtime.started" not in [e["event"] for e in events]

    # [logging] format = "console", level = "debug" from the program's own config file
    lines = runs["configured"].stderr.splitlines()
    assert any("generator.step" in line and "[debug" in line for line in lines), lines[:20]
    assert any("request.finished" in line for line in lines)
    assert not any(line.startswith("{") for line in lines)

    # the host's level on the `mmserve` logger wins over [logging] level = "info"
    assert runs["host_level"].stderr.strip() == "", runs["host_level"].stderr[:2000]

    # the host's root handler prints each event once, in the host's format; mmserve adds none
    lines = runs["host_root"].stderr.splitlines()
    assert lines and all(line.startswith("HOST INFO mmserve.") for line in lines), lines[:5]
    finished = [line for line in lines if '"event": "request.finished"' in line]
    assert len(finished) == 1
    started = json.loads(next(line for line in lines if '"runtime.started"' in line).split(" ", 3)[3])
    assert started["models"] == ["demo", "demo-wide", "demo-qwen"]  # the packaged default config
