"""The mmserve instances under test: embedded runtimes and HTTP servers (in its own process, as
deployed, or in the benchmark's own trio run for fast tests).

`python -m mmserve.bench.servers CONFIG` serves like `mmserve serve --config CONFIG` (the same
`serve`, stopped by SIGINT/SIGTERM), logging JSON at the config's level to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import trio

from mmserve.bench.common import MODEL
from mmserve.bench.processes import die_with_parent, stop
from mmserve.config import Config, ModelConfig
from mmserve.runtime.runtime import Runtime

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 30


def bench_config(model_dir: Path, threads: int, prefix: bool = True, encoder: bool = True, *,
                 device: str = "cpu", dtype: str = "float32", kv_budget_bytes: int | None = None) -> Config:
    """One model, named `bench`, with the prefix and encoder caches on or off, on `device` in
    `dtype` (a KV arena of `kv_budget_bytes`; None: the default)."""
    kv = {"prefix_caching": prefix} | ({"budget_bytes": kv_budget_bytes} if kv_budget_bytes else {})
    return Config(models=(ModelConfig(MODEL, str(Path(model_dir).resolve()), default=True),)).replace(
        runtime={"torch_threads": threads, "device": device, "dtype": dtype}, kv_cache=kv,
        encoder_cache={"enabled": encoder}, server={"host": "127.0.0.1", "port": 0},
        logging={"format": "json", "level": "info"})


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def _toml_table(header: str, name: str, values: dict, lines: list[str]) -> None:
    """`values` under `header` (e.g. "[limits]"), nested sections as sub-tables ("[limits.x]")."""
    lines.append(header)
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None and not isinstance(v, dict)]
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_table(f"[{name}.{k}]", f"{name}.{k}", v, lines)


def config_toml(config: Config) -> str:
    """The config as a TOML file `mmserve serve --config` reads back to the same Config."""
    lines: list[str] = []
    for f in dataclasses.fields(config):
        if f.name != "models":
            _toml_table(f"[{f.name}]", f.name, dataclasses.asdict(getattr(config, f.name)), lines)
    for m in config.models:
        _toml_table("[[models]]", "models", dataclasses.asdict(m), lines)
    return "\n".join(lines) + "\n"


@asynccontextmanager
async def inprocess_server(config: Config) -> AsyncIterator[str]:
    """`serve` in this trio run; yields its URL."""
    from mmserve.api.server import serve

    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(lambda task_status: serve(config, shutdown=shutdown, task_status=task_status))
        try:
            yield urls[0]
        finally:
            shutdown.set()


@asynccontextmanager
async def subprocess_server(config: Config, workdir: Path) -> AsyncIterator[str]:
    """`mmserve serve` in its own process; its log goes to `workdir/server-*.log`. Yields its URL.
    The process is stopped and waited for on every way out (see `mmserve.bench.processes`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"p{int(config.kv_cache.prefix_caching)}e{int(config.encoder_cache.enabled)}" + "d" * config.runtime.deterministic
    cfg, log = workdir / f"server-{tag}.toml", workdir / f"server-{tag}.log"
    cfg.write_text(config_toml(config))
    with log.open("w") as log_file:
        # SIGTERM if this process dies without its finally (SIGKILL): the server drains and exits
        proc = subprocess.Popen([sys.executable, "-m", "mmserve.bench.servers", str(cfg)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent(signal.SIGTERM))
    try:
        yield await _listening_url(proc, log)
    finally:  # also when cancelled: shielded, SIGINT, STOP_TIMEOUT_S, then SIGKILL; always waited for
        await stop(proc, signal.SIGINT, STOP_TIMEOUT_S)


async def _listening_url(proc: subprocess.Popen, log: Path) -> str:
    with trio.fail_after(START_TIMEOUT_S):
        while True:
            for line in log.read_text().splitlines():
                if '"http.listening"' in line:
                    return json.loads(line)["urls"][0]
            if proc.poll() is not None:
                raise RuntimeError(f"mmserve serve exited with {proc.returncode}; see {log}")
            await trio.sleep(0.2)


@asynccontextmanager
async def http_server(config: Config, mode: str, workdir: Path) -> AsyncIterator[str]:
    if mode == "inprocess":
        cm = inprocess_server(config)
    elif mode == "subprocess":
        cm = subprocess_server(config, workdir)
    else:
        raise ValueError(f"unknown http mode {mode!r}")
    async with cm as url:
        yield url


def open_runtime(config: Config):
    return Runtime.open(config)


def main(config_path: str) -> None:
    from functools import partial

    from mmserve.api.server import serve
    from mmserve.logs import configure_logging
    from mmserve.config import load_config

    config = load_config(config_path)
    configure_logging(config.logging.format, config.logging.level)

    async def run():
        shutdown = trio.Event()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(serve, config, shutdown=shutdown))
                async for _ in signals:
                    shutdown.set()
                    break

    trio.run(run)


if __name__ == "__main__":
    main(sys.argv[1])
