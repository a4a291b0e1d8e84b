"""`mmserve serve | train-demo | make-model | bench` — the command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import trio

from mmserve.errors import MMServeError
from mmserve.logs import configure_logging, get_logger


def _serve(args: argparse.Namespace) -> int:
    from mmserve.api.server import serve
    from mmserve.config import load_config, with_models
    from mmserve.engine.attention import check_attention
    from mmserve.models.loading import check_checkpoint

    try:
        config = load_config(args.config)
        if args.model:
            config = with_models(config, args.model)
        server = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        config = config.replace(server=server) if server else config
        for model in config.models:  # every model, loaded at start or on demand: found now, not at its first request
            check_checkpoint(model.name, model.resolved_path())
            check_attention(model.name, model.resolved_path())
    except (OSError, ValueError) as err:  # the operator's error (CheckpointError is a ValueError): one line, no traceback
        print(f"mmserve serve: {err}", file=sys.stderr)
        return 1
    configure_logging(args.log_format or config.logging.format, args.log_level or config.logging.level)

    log = get_logger("runtime")
    forced = []

    async def main():
        shutdown = trio.Event()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def run_server():
                    await serve(config, shutdown=shutdown)
                    nursery.cancel_scope.cancel()  # stopped (drained): stop listening for signals
                nursery.start_soon(run_server)
                async for signum in signals:
                    if shutdown.is_set():  # a second signal: stop now
                        log.warning("runtime.stop_forced", signal=signal.Signals(signum).name)
                        forced.append(signum)
                        nursery.cancel_scope.cancel()
                        return
                    log.info("runtime.signal", signal=signal.Signals(signum).name)
                    shutdown.set()
                    nursery.start_soon(_exit_deadline, config.server.shutdown_grace_s + 5.0)

    failures: list[MMServeError] = []
    try:
        trio.run(main)
    except* MMServeError as group:
        failures.extend(group.exceptions)
    for err in failures:
        print(f"mmserve serve: {err.message}", file=sys.stderr)
    code = 1 if failures or forced else 0
    _exit_now_if_a_step_is_stuck(code)
    return code


async def _exit_deadline(seconds: float) -> None:
    """A hung model step (or anything else) never holds the exit beyond grace + 5 s."""
    await trio.sleep(seconds)
    get_logger("runtime").error("runtime.exit_forced", after_s=seconds)
    _flush_and_exit(1)


def _exit_now_if_a_step_is_stuck(code: int) -> None:
    """Python joins the compute thread at exit, after the steps queued for it: a step hung in it,
    or one an abandoned caller left queued (which would start, then hang), would hold the process."""
    from mmserve.actors import compute

    if not compute.stop():
        _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train_demo(args: argparse.Namespace) -> int:
    from mmserve.models.demo import train_demo_models

    names = [*(args.names or ()), *(args.name or ())]
    train_demo_models(out_root=args.out, names=tuple(names or ("demo", "demo-wide")))
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from mmserve.models.demo import build_untrained

    try:
        path = build_untrained(args.preset, args.out, seed=args.seed, random_weights=args.random_weights)
    except (ValueError, FileExistsError) as err:
        print(f"mmserve make-model: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mmserve.bench.extra import missing_message

    problem = missing_message()  # before importing the benchmark: one line, not an ImportError
    if problem:
        print(f"mmserve bench: {problem}", file=sys.stderr)
        return 2
    from mmserve.bench import PARAMS, run_bench
    from mmserve.bench.model import FAMILY_PRESETS, is_preset

    if args.quick and args.params not in (None, "quick"):
        print(f"mmserve bench: --quick and --params {args.params} disagree", file=sys.stderr)
        return 2
    params = PARAMS[args.params or ("quick" if args.quick else "full")]
    if args.preset:
        if not is_preset(args.preset):
            known = "; ".join(f"{name}: {', '.join(presets)}" for name, presets in FAMILY_PRESETS.items())
            print(f"mmserve bench: unknown preset {args.preset!r}; {known}", file=sys.stderr)
            return 2
        params = replace(params, preset=args.preset)
    if args.scenarios:
        params = replace(params, scenarios=args.scenarios)
    if args.deterministic:
        params = replace(params, deterministic=True)
    if args.random_weights and args.model_dir:
        print("mmserve bench: --random-weights builds the model; it does not apply to --model-dir", file=sys.stderr)
        return 2
    try:
        params = replace(params, **device_options(args, params))
    except ValueError as err:
        print(f"mmserve bench: {err}", file=sys.stderr)
        return 2
    try:
        report = run_bench(args.out, params, model_dir=args.model_dir)
    except KeyboardInterrupt:  # the bench stopped every process it started; no traceback for a Ctrl-C
        print("mmserve bench: interrupted; no report written", file=sys.stderr)
        return 130
    print(report["paths"]["md"])
    return 0 if all(r.get("status") in ("ok", "skipped") for r in report["scenarios"].values()) else 1


def device_options(args: argparse.Namespace, params=None) -> dict:
    """The bench's --device / --dtype / --random-weights / --kv-budget-mib as BenchParams fields
    (a device or dtype not given: the parameter set's); ValueError for a device the runtime config
    would refuse, or a CUDA device torch does not have."""
    from mmserve.config import RuntimeConfig

    device = args.device or (params.device if params is not None else "cpu")
    dtype = args.dtype or (params.dtype if params is not None else "float32")
    RuntimeConfig(device=device, dtype=dtype)  # the same checks as [runtime]
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    out = {"device": device, "dtype": dtype, "random_weights": args.random_weights or bool(params and params.random_weights)}
    if args.kv_budget_mib is not None:
        out["kv_budget_mib"] = args.kv_budget_mib
    return out


def _scenario_list(text: str) -> tuple[str, ...]:
    from mmserve.bench.params import KNOWN_SCENARIOS

    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(KNOWN_SCENARIOS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(KNOWN_SCENARIOS)}")
    return tuple(n for n in KNOWN_SCENARIOS if n in names)


def _trace(args: argparse.Namespace) -> int:
    from mmserve.trace import main as trace

    if args.log == "-":
        if sys.stdin.isatty():  # nothing piped in: waiting would look like a hang
            from mmserve.trace import JSON_HINT

            print(f"mmserve trace: no log given (--log FILE, or pipe one in); {JSON_HINT}", file=sys.stderr)
            return 2
        return trace(args.request_id, sys.stdin, args.json)
    with open(args.log, encoding="utf-8", errors="replace") as f:
        return trace(args.request_id, f, args.json)


def build_parser() -> argparse.ArgumentParser:
    from mmserve.config.checks import known_builtins
    from mmserve.models.loading import FAMILIES

    p = argparse.ArgumentParser(prog="mmserve", description="Serve multimodal language models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the configured models over an OpenAI-compatible HTTP API")
    s.add_argument("--config", help="path to config.toml (default: built-in defaults, the demo model)")
    s.add_argument("--host", help="the address to listen on (default: [server] host, 127.0.0.1); 0.0.0.0 only "
                   "behind a trusted network")
    s.add_argument("--port", type=int, help="the port to listen on (default: [server] port, 8000); 0 picks a free "
                   "port (the chosen address is logged as http.listening)")
    s.add_argument("--model", action="append", help="serve only this model (repeatable; the first is the default): "
                   f"a name from the config, a checkpoint directory (model_type {' or '.join(FAMILIES)}), or a "
                   f"built-in demo: {', '.join(known_builtins())}")
    s.add_argument("--log-format", choices=["json", "console"])
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=_serve)

    t = sub.add_parser("train-demo", help="retrain the demo models (deterministic, a few minutes on a CPU)")
    t.add_argument("--out", help="output root (default: the committed checkpoints in the package)")
    t.add_argument("names", nargs="*", help="demo models to train: demo, demo-wide (the default), demo-qwen")
    t.add_argument("--name", action="append", help="train only this demo model (repeatable)")
    t.set_defaults(func=_train_demo)

    m = sub.add_parser("make-model", help="build a random-weight LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL or "
                       "LLaVA-OneVision checkpoint of a preset shape")
    m.add_argument("--preset", default="bench", help="LLaVA: tiny | demo | demo-wide | bench | llava-7b (~14 GB, "
                   "bfloat16); Qwen2-VL: tiny-qwen | demo-qwen | bench-qwen | qwen2-vl-7b (~15 GB, bfloat16); "
                   "Qwen2.5-VL: tiny-qwen2.5-vl | qwen2.5-vl-7b (~14 GB, bfloat16); Qwen3-VL: tiny-qwen3-vl | "
                   "qwen3-vl-8b (~15 GB, bfloat16); LLaVA-OneVision: "
                   "tiny-llava-onevision | llava-onevision-7b (~14 GB, bfloat16); Idefics3/SmolVLM: "
                   "tiny-idefics3 | smolvlm-2b (~4 GB, bfloat16); Gemma 3: tiny-gemma3 | gemma3-4b (~8 GB, "
                   "bfloat16)")
    m.add_argument("--out", required=True, help="the directory to write the checkpoint into (created if missing); "
                   "serve it with `mmserve serve --model DIR`")
    m.add_argument("--seed", type=int, default=0, help="the seed of the random weights (default: 0); a seed always "
                   "gives the same weights")
    m.add_argument("--random-weights", action="store_true", help="write no weight file: config, processor, "
                   "tokenizer and a marker (mmserve-random-weights.json: seed, dtype, silenced tokens); mmserve "
                   "draws the weights from the seed when it loads the directory, directly on its device "
                   "(seconds, even for llava-7b / qwen2-vl-7b / qwen2.5-vl-7b / qwen3-vl-8b on a GPU)")
    m.set_defaults(func=_make_model)

    b = sub.add_parser("bench", help="benchmark mmserve side by side with raw transformers and with its caches off")
    b.add_argument("--model-dir", help="a LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, Idefics3/SmolVLM "
                   "or Gemma 3 checkpoint, the family read from its config.json (default: build the random-weight "
                   "--preset into <out>/<preset>-model, reused when present)")
    b.add_argument("--preset", help="the random-weight model to build without --model-dir: bench (LLaVA, the "
                   "default) or bench-qwen (Qwen2-VL); tiny / tiny-qwen / tiny-qwen2.5-vl / tiny-qwen3-vl / "
                   "tiny-llava-onevision / tiny-idefics3 / tiny-gemma3 for tests; llava-7b / qwen2-vl-7b / "
                   "qwen2.5-vl-7b / qwen3-vl-8b / llava-onevision-7b / smolvlm-2b / gemma3-4b (the real 2-8B "
                   "shapes, for a GPU: always built as random-weights directories)")
    b.add_argument("--random-weights", action="store_true", help="build the preset as a random-weights directory "
                   "(config and processor, no weights file; every side draws the same weights from its seed, "
                   "directly on the device) into <out>/<preset>-random-model")
    b.add_argument("--device", help="where mmserve ([runtime] device) and the baselines run: cpu "
                   "(the default; --params gpu: cuda), cuda, cuda:N")
    b.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="mmserve's [runtime] dtype and the baselines' (default: float32; --params gpu: bfloat16)")
    b.add_argument("--kv-budget-mib", type=int, help="mmserve's KV arena per model, in MiB (default: the config's "
                   "256 MiB on the CPU, 8192 on CUDA)")
    b.add_argument("--out", default="bench-out", help="where report.json, report.md and report.png go")
    b.add_argument("--params", choices=("full", "quick", "test", "gpu"), help="the parameter set (default: full); "
                   "test: seconds, for checking the machinery; gpu: llava-7b on cuda in bfloat16, 1/8/32 concurrent")
    b.add_argument("--quick", action="store_true", help="the same as --params quick: fewer tokens, levels and "
                   "turns (a few minutes)")
    b.add_argument("--deterministic", action="store_true", help="mmserve runs with [runtime] deterministic = true "
                   "(bit-exact answers whatever the cache, batch or chunking): the mode's cost, against a run without")
    b.add_argument("--scenarios", type=_scenario_list, help="run only these, comma-separated, in the usual order: "
                   "decode, concurrency, multiturn, same_image, three_images, peer, replicas, structured (default: all)")
    b.set_defaults(func=_bench)
    tr = sub.add_parser("trace", help="one request's timeline across actors, from a JSON log")
    tr.add_argument("request_id", help="the completion's id as the API returns it (chatcmpl-...), the internal "
                    "request id, or a client's X-Request-Id (all its requests)")
    tr.add_argument("--log", default="-", help="the JSON log file, or - for standard input (default)")
    tr.add_argument("--json", action="store_true", help="machine-readable output")
    tr.set_defaults(func=_trace)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
