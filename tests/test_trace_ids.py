"""`mmserve trace` takes the id as the API returns it (`chatcmpl-…`), as well as the bare internal id
the log names and a client's X-Request-Id label."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mmserve.runtime.stream import ChatStream
from mmserve.trace import COMPLETION_ID_PREFIX, TEXT_COMPLETION_ID_PREFIX, main as trace

RID, OTHER = "5f0c2d9e8a7b4c3d9e8f7a6b5c4d3e2f", "0" * 32


def log_lines() -> list[str]:
    events = [
        {"event": "request.received", "request_id": RID, "client_request_id": "retry-7", "actor": "http"},
        {"event": "request.received", "request_id": OTHER, "actor": "http"},
        {"event": "generator.step", "request_ids": [RID, OTHER], "actor": "generator"},
        {"event": "request.finished", "request_id": RID, "actor": "http"},
        {"event": "request.finished", "request_id": OTHER, "actor": "http"},
    ]
    return [json.dumps({**e, "timestamp": f"2026-11-25T10:00:00.00{i}Z", "level": "info"}) + "\n"
            for i, e in enumerate(events)]


def traced(request_id: str) -> tuple[int, list[dict]]:
    out = io.StringIO()
    status = trace(request_id, io.StringIO("".join(log_lines())), as_json=True, out=out)
    return status, json.loads(out.getvalue()) if status == 0 else []


def test_the_id_the_api_returns_finds_the_request():
    status, rows = traced(COMPLETION_ID_PREFIX + RID)
    assert status == 0
    assert [r["event"] for r in rows] == ["request.received", "generator.step", "request.finished"]
    assert traced(RID) == (status, rows)  # the bare id: the same timeline
    assert traced("retry-7") == (status, rows)  # the client's label


def test_the_prefix_is_the_one_completion_ids_carry():
    fake = SimpleNamespace(handle=SimpleNamespace(request_id=RID, request=SimpleNamespace(prompt=None)))
    assert ChatStream.id.fget(fake) == COMPLETION_ID_PREFIX + RID
    legacy = SimpleNamespace(handle=SimpleNamespace(request_id=RID, request=SimpleNamespace(prompt="raw")))
    assert ChatStream.id.fget(legacy) == TEXT_COMPLETION_ID_PREFIX + RID
    assert traced(TEXT_COMPLETION_ID_PREFIX + RID) == traced(COMPLETION_ID_PREFIX + RID)


def test_an_unknown_id_finds_nothing():
    assert traced(COMPLETION_ID_PREFIX + "f" * 32) == (1, [])


def test_the_cli_takes_the_completion_id(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("".join(log_lines()))
    proc = subprocess.run([sys.executable, "-m", "mmserve.cli", "trace", COMPLETION_ID_PREFIX + RID, "--log", str(log)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "request.received" in proc.stdout and "request.finished" in proc.stdout


def test_a_console_format_log_is_named_with_how_to_write_json(tmp_path, capsys):
    console = "".join(f"2026-11-25T10:00:00.00{i}Z [info     ] request.received    request_id={RID}\n"
                      for i in range(3))
    assert trace(RID, io.StringIO(console)) == 2
    err = capsys.readouterr().err
    assert "console format" in err and "--log-format json" in err and "2> mmserve.log" in err


def test_a_terminal_stdin_is_refused_with_a_hint_not_waited_on():
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "mmserve.cli", "trace", RID], stdin=follower,
                              capture_output=True, text=True, timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert proc.returncode == 2 and "--log FILE" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.slow  # a CLI subprocess (~7 s); keeps make test under 10 minutes
def test_a_closed_pipe_ends_it_quietly(tmp_path):
    log = tmp_path / "server.log"
    step = {"event": "generator.step", "request_ids": [RID], "actor": "generator", "level": "info"}
    log.write_text("".join(json.dumps({**step, "n": i, "timestamp": f"2026-11-25T10:00:{i // 1000:02d}.{i % 1000:03d}Z"})
                           + "\n" for i in range(3000)))  # far more than a pipe's buffer of output
    proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "trace", RID, "--json", "--log", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err
