"""Train the demo checkpoints from scratch on synthetic data (CPU, deterministic).

``python -m mmserve.models.demo.train [--out ROOT] [NAME ...]`` or ``mmserve train-demo``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import time

import numpy as np
import torch
import torch.nn.functional as F

from . import data
from .build import build_model, build_processor, checkpoint_dir, get_preset, save


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 48
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bank_size: int = 30000
    seed: int = 0
    threads: int = 2
    log_every: int = 100
    mix: data.TaskMix = dataclasses.field(default_factory=data.TaskMix)


TRAIN_CONFIGS: dict[str, TrainConfig] = {
    "demo": TrainConfig(),
    "demo-wide": TrainConfig(),
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def answer_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on the labelled positions only (lm_head applied just there).

    Returns (loss, per-position correctness of the argmax) for logging.
    """
    out = model.model(
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        attention_mask=batch["attention_mask"],
    )
    hidden = out.last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    logits = model.lm_head(hidden[mask])
    tgt = targets[mask]
    return F.cross_entropy(logits, tgt), (logits.argmax(-1) == tgt)


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(
    preset: str,
    out_dir,
    cfg: TrainConfig | None = None,
    log=print,
    bank: data.ImageBank | None = None,
) -> dict:
    """Build ``preset`` from scratch, train it, save to out_dir. Returns a small stats dict."""
    p = get_preset(preset)
    cfg = cfg or TRAIN_CONFIGS.get(p.name, TrainConfig())
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    processor = build_processor(p)
    model = build_model(p, processor.tokenizer, seed=cfg.seed)
    if bank is None or bank.size != p.image_size or len(bank) != cfg.bank_size:
        bank = data.ImageBank(p.image_size, cfg.bank_size, seed=cfg.seed)
    t_bank = time.perf_counter() - t0
    sampler = data.BatchSampler(processor.tokenizer, p.num_image_tokens, bank, seed=cfg.seed, mix=cfg.mix)
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    n_params = sum(q.numel() for q in model.parameters())
    log(f"[{p.name}] {n_params / 1e6:.2f} M params, {p.num_image_tokens} image tokens, "
        f"{cfg.steps} steps x {cfg.batch_size}, lr {cfg.lr} (setup {t_bank:.1f}s)")
    run_loss, run_acc, run_n = 0.0, 0.0, 0
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sampler.batch(cfg.batch_size)
        loss, correct = answer_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        run_loss += loss.item()
        run_acc += correct.float().mean().item()
        run_n += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            el = time.perf_counter() - t_start
            log(f"[{p.name}] step {step + 1}/{cfg.steps} loss {run_loss / run_n:.4f} "
                f"tok-acc {run_acc / run_n:.3f} lr {lr_at(step, cfg):.2e} {el:.0f}s")
            run_loss, run_acc, run_n = 0.0, 0.0, 0
    model.eval()
    out = save(model, processor, out_dir)
    wall = time.perf_counter() - t0
    log(f"[{p.name}] saved to {out} ({wall:.0f}s total)")
    return {"name": p.name, "seconds": wall, "path": str(out), "params": n_params}


def train_demo_models(out_root=None, names=("demo", "demo-wide"), log=print) -> list[dict]:
    """Build and train each named demo model into ``checkpoint_dir(name)`` (or out_root/name)."""
    results = []
    bank = None
    for name in names:
        out = pathlib.Path(out_root) / name if out_root is not None else checkpoint_dir(name)
        cfg = TRAIN_CONFIGS.get(name, TrainConfig())
        p = get_preset(name)
        if bank is None or bank.size != p.image_size or len(bank) != cfg.bank_size:
            t = time.perf_counter()
            bank = data.ImageBank(p.image_size, cfg.bank_size, seed=cfg.seed)
            log(f"rendered {len(bank)} training images in {time.perf_counter() - t:.1f}s")
        results.append(train(name, out, cfg, log=log, bank=bank))
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", default=["demo", "demo-wide"])
    ap.add_argument("--out", default=None, help="output root (default: the committed checkpoints dir)")
    args = ap.parse_args(argv)
    train_demo_models(args.out, tuple(args.names))


if __name__ == "__main__":
    main()
