"""Scenario 6's peer: HF `transformers serve` on the benchmark's model, started and stopped by the
benchmark on 127.0.0.1 (optional: `pip install -e '.[bench]'`, i.e. `transformers[serving]`).

What `transformers serve` (5.x) does with a LLaVA checkpoint, read from its source and checked by
hand: the positional FORCE_MODEL argument preloads a local checkpoint directory before the server
listens (so a 200 from /health means the model is loaded) and pins every request to it (the request's
"model" must be that string or absent). `/v1/chat/completions` takes OpenAI image_url parts with
data: URLs and streams SSE with a final chunk carrying `usage`. Requests run one at a time:
`model.generate` on a single inference thread (its continuous batching is for text-only models; a
VLM falls back to sequential generation). It rejects `min_tokens` (422), so a fixed length is asked
for through its `generation_config` field (`min_new_tokens = max_new_tokens`, `do_sample = false`,
merged with the checkpoint's generation config by `generate`); the token counts it reports are
checked, and tokens/s always uses the counts actually generated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from time import perf_counter
from typing import AsyncIterator

import httpx
import trio

from mmserve.bench.common import Timing, timed_sse
from mmserve.bench.processes import die_with_parent

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 15
# What `transformers serve` imports beyond transformers itself (transformers' `is_serve_available`).
MODULES = ("fastapi", "uvicorn", "pydantic", "openai")
LOG = "peer-server.log"  # in the benchmark's output directory
_LISTENING = re.compile(r"Uvicorn running on (http://\S+)")


class PeerError(RuntimeError):
    """The peer failed to start, or failed a request; `log_tail` is the end of its output."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def unavailable() -> str | None:
    """Why `transformers serve` cannot run here, or None when it can."""
    if importlib.util.find_spec("transformers.cli.serve") is None:
        return "this transformers has no `transformers serve` (transformers.cli.serve)"
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"`transformers serve` needs {', '.join(missing)} (transformers[serving]), not installed here; "
                "install with `pip install -e '.[bench]'`")
    return None


def unsupported(family: str) -> str | None:
    """Why `transformers serve` cannot serve a checkpoint of this family here, or None."""
    # bench.model.QWEN_FAMILIES and LLaVA-OneVision (no builders here)
    names = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL",
             "llava_onevision": "LLaVA-OneVision"}
    if family in names:
        return (f"`transformers serve` loads a {names[family]} checkpoint with AutoProcessor, whose video "
                "processor needs torchvision (no build of it fits this torch)")
    return None


def command(model_dir: Path) -> list[str]:
    """`transformers serve` for `model_dir` on 127.0.0.1, a free port (uvicorn logs the one it got),
    on the CPU in float32 (as mmserve and the HF baseline run it)."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", "0", "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]


def environment(threads: int) -> dict[str, str]:
    """Offline (no Hub access, no update check) with `threads` torch threads."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1",
                HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def log_tail(log: Path, lines: int = 15, chars: int = 2000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip() and "%|" not in ln]  # no progress-bar frames
    return "\n".join(kept[-lines:])[-chars:]


@asynccontextmanager
async def serve(model_dir: Path, threads: int, workdir: Path) -> AsyncIterator[str]:
    """`transformers serve` in its own process group, output to `workdir/LOG`; yields its
    URL once /health answers 200. Always stopped (SIGTERM to the group, then SIGKILL)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / LOG
    with log.open("w") as log_file:
        proc = subprocess.Popen(command(Path(model_dir).resolve()), stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, env=environment(threads), start_new_session=True,
                                preexec_fn=die_with_parent(signal.SIGTERM))  # if the benchmark is SIGKILLed
    try:
        yield await _ready(proc, log)
    finally:
        with trio.CancelScope(shield=True):
            await stop(proc)


async def _ready(proc: subprocess.Popen, log: Path) -> str:
    url = None
    start = perf_counter()
    async with httpx.AsyncClient(timeout=5) as client:
        while perf_counter() - start < START_TIMEOUT_S:
            if proc.poll() is not None:
                raise PeerError(f"`transformers serve` exited with code {proc.returncode} while starting", log_tail(log))
            if url is None and (m := _LISTENING.search(log.read_text(errors="replace"))):
                url = m.group(1).rstrip("/")
            if url is not None:
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            await trio.sleep(0.2)
    raise PeerError(f"`transformers serve` was not ready after {START_TIMEOUT_S} s", log_tail(log))


async def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            await trio.to_thread.run_sync(proc.wait, wait)
        except subprocess.TimeoutExpired:
            continue


def request_body(model: str, messages: list[dict], tokens: int) -> dict:
    """Greedy decoding of exactly `tokens` tokens, as far as `transformers serve` takes it."""
    gen = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens}
    return {"model": model, "messages": messages, "stream": True, "max_tokens": tokens,
            "generation_config": json.dumps(gen)}


async def timed_peer(client: httpx.AsyncClient, url: str, messages: list[dict], tokens: int, *, model: str) -> Timing:
    """One streaming request to `transformers serve`, its first token being its first text (it sends
    its role chunk before generating; mmserve is timed the same way in this scenario)."""
    return await timed_sse(client, url, request_body(model, messages, tokens), first="text")


def describe(model_dir: Path) -> dict:
    import transformers

    return {"transformers": transformers.__version__, "command": command(Path(model_dir).resolve()),
            "continuous_batching": False,
            "scheduling": "one request at a time (model.generate on one inference thread; continuous batching "
                          "in transformers serve is for text-only models)",
            "fixed_length": "generation_config min_new_tokens = max_new_tokens (min_tokens is rejected)"}
