"""Train the demo checkpoints from scratch on synthetic data (CPU, deterministic).

``python -m mmserve.models.demo.train [--out ROOT] [NAME ...]`` or ``mmserve train-demo``.

Two stages per model:

1. **Vision pre-training** (cheap: the tower sees only its own 17 tokens). The CLIP tower plus
   throw-away linear heads on its mean-pooled last-layer patch features learn to classify shape,
   colour and background (~99.8% shape on held-out images after 1500 steps). A tiny ViT trained
   only through the language model learns shape very slowly (the feasibility run stalled at
   ~60-66%). Models with the same vision config share this stage (same seed: same weights).
   The tower's residual stream is then rescaled (function-preserving) so its features have std 1
   instead of ~7: with features ~100x larger than the text embeddings, the language model learned
   first/second slowly and, at higher learning rates, sometimes never learned to read background.
2. **LLaVA training** with the tower frozen (fine-tuning it from the start wrecked its features):
   projector + Llama on chat-formatted conversations; loss only on the final answer and ``</s>``.
   At lr 3e-3 background/shape reading got stuck at chance in several runs; 1.5e-3 is reliable.

Training is deterministic (seeded; fixed thread count): a re-run gives byte-identical weights.
About 7 minutes for both models on an idle 2-core machine (stage 1 ~50 s, demo ~135 s,
demo-wide ~220 s, rendering ~10 s); more when the CPU is shared.
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
from transformers import CLIPVisionModel

from . import data, render
from .build import build_model, build_processor, checkpoint_dir, get_preset, save


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # stage 1: vision pre-training
    vision_steps: int = 1500
    vision_batch_size: int = 64
    vision_lr: float = 2e-3
    vision_warmup: int = 200
    vision_lr_mult: float = 0.0  # stage 2 learning rate of the tower (x lr); 0 = frozen
    vision_feature_std: float = 1.0  # rescale the tower's features to this std (0: leave as is)
    # stage 2: LLaVA
    steps: int = 1200
    batch_size: int = 48
    lr: float = 1.5e-3
    min_lr_frac: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bank_size: int = 20000
    seed: int = 0
    threads: int = 2
    log_every: int = 100
    mix: data.TaskMix = dataclasses.field(default_factory=data.TaskMix)


TRAIN_CONFIGS: dict[str, TrainConfig] = {
    "demo": TrainConfig(),
    "demo-wide": TrainConfig(),
}


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _param_groups(named_params, weight_decay: float):
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------------------------
# stage 1


def pretrain_vision(vision_config, bank: data.ImageBank, cfg: TrainConfig, log=print) -> dict[str, torch.Tensor]:
    """Train a CLIP tower as a shape/colour/background classifier; return its state dict."""
    torch.manual_seed(cfg.seed + 1)
    tower = CLIPVisionModel(vision_config)
    hidden = vision_config.hidden_size
    heads = torch.nn.ModuleDict({
        "shape": torch.nn.Linear(hidden, len(render.SHAPES)),
        "color": torch.nn.Linear(hidden, len(render.COLORS)),
        "background": torch.nn.Linear(hidden, len(render.BACKGROUNDS)),
    })
    x_all = torch.from_numpy(data.normalize(bank.pixels))
    y_all = {
        "shape": torch.tensor([render.SHAPES.index(s.shape) for s in bank.specs]),
        "color": torch.tensor([render.COLORS.index(s.color) for s in bank.specs]),
        "background": torch.tensor([render.BACKGROUNDS.index(s.background) for s in bank.specs]),
    }
    params = [*tower.named_parameters(), *heads.named_parameters()]
    opt = torch.optim.AdamW(_param_groups(params, cfg.weight_decay), lr=cfg.vision_lr)
    rng = np.random.default_rng([cfg.seed, 0x7151])
    tower.train()
    t0 = time.perf_counter()
    run = {"loss": 0.0, "shape": 0.0, "n": 0}
    for step in range(cfg.vision_steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.vision_steps, cfg.vision_lr, cfg.vision_warmup, cfg.min_lr_frac)
        idx = torch.from_numpy(rng.integers(len(bank), size=cfg.vision_batch_size))
        out = tower(pixel_values=x_all[idx], output_hidden_states=True)
        feat = out.hidden_states[-1][:, 1:].mean(1)  # mean of what LLaVA reads (CLS dropped)
        loss = 0.0
        for k in ("shape", "color", "background"):
            logits = heads[k](feat)
            loss = loss + F.cross_entropy(logits, y_all[k][idx])
            if k == "shape":
                run["shape"] += (logits.argmax(-1) == y_all[k][idx]).float().mean().item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run["loss"] += loss.item()
        run["n"] += 1
        if (step + 1) % (2 * cfg.log_every) == 0 or step + 1 == cfg.vision_steps:
            log(f"  vision step {step + 1}/{cfg.vision_steps} loss {run['loss'] / run['n']:.4f} "
                f"shape-acc {run['shape'] / run['n']:.3f} {time.perf_counter() - t0:.0f}s")
            run = {"loss": 0.0, "shape": 0.0, "n": 0}
    return {k: v.detach().clone() for k, v in tower.state_dict().items()}


@torch.no_grad()
def rescale_vision_features(tower, pixel_values: torch.Tensor, target_std: float = 1.0) -> float:
    """Scale the tower's residual stream so its last-layer features have std ``target_std``.

    In a pre-LN transformer the LayerNorms are scale-invariant, so multiplying the stream's
    sources (``pre_layrnorm``'s affine, each ``out_proj`` and ``fc2``) by c multiplies every
    hidden state by c and changes nothing else. A classifier-trained tower ends up with features
    of std ~7; the text embeddings start at 0.02: bringing them closer makes stage 2 learn faster.
    """
    feats = tower(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-1][:, 1:]
    c = target_std / feats.float().std().item()
    vm = getattr(tower, "vision_model", tower)  # transformers 5 flattened CLIPVisionModel
    for mod in (vm.pre_layrnorm,
                *(layer.self_attn.out_proj for layer in vm.encoder.layers),
                *(layer.mlp.fc2 for layer in vm.encoder.layers)):
        mod.weight.mul_(c)
        mod.bias.mul_(c)
    return c


# --------------------------------------------------------------------------------------------
# stage 2


def answer_loss(model, batch: dict[str, torch.Tensor]):
    """Cross-entropy on the labelled positions only (lm_head applied just there).

    Returns (loss, per-example correctness of the first answer token).
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
    loss = F.cross_entropy(logits, tgt)
    # first labelled position of each row = the answer word
    counts = mask.sum(1)
    first = torch.cumsum(counts, 0) - counts
    correct = logits[first].argmax(-1) == tgt[first]
    return loss, correct


def train(
    preset,
    out_dir,
    cfg: TrainConfig | None = None,
    log=print,
    bank: data.ImageBank | None = None,
    vision_cache: dict | None = None,
    check_n: int = 60,
) -> dict:
    """Build ``preset`` from scratch, train it, save to out_dir. Returns a small stats dict."""
    p = get_preset(preset)
    cfg = cfg or TRAIN_CONFIGS.get(p.name, TrainConfig())
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    if bank is None or bank.size != p.image_size or len(bank) != cfg.bank_size:
        bank = data.ImageBank(p.image_size, cfg.bank_size, seed=cfg.seed)
        log(f"[{p.name}] rendered {len(bank)} training images in {time.perf_counter() - t0:.1f}s")
    processor = build_processor(p)
    model = build_model(p, processor.tokenizer, seed=cfg.seed)

    # stage 1 (shared between models with the same vision tower and schedule)
    vcfg = model.config.vision_config
    key = (repr(sorted(vcfg.to_dict().items())), cfg.vision_steps, cfg.vision_batch_size, cfg.vision_lr,
           cfg.vision_warmup, cfg.min_lr_frac, cfg.weight_decay, cfg.seed, len(bank), bank.size)
    vision_cache = {} if vision_cache is None else vision_cache
    t1 = time.perf_counter()
    if cfg.vision_steps > 0:
        if key not in vision_cache:
            log(f"[{p.name}] stage 1: vision pre-training ({cfg.vision_steps} steps)")
            vision_cache[key] = pretrain_vision(vcfg, bank, cfg, log=log)
        else:
            log(f"[{p.name}] stage 1: reusing the pre-trained vision tower")
        model.model.vision_tower.load_state_dict(vision_cache[key])
        if cfg.vision_feature_std > 0:
            sample = torch.from_numpy(data.normalize(bank.pixels[:256]))
            c = rescale_vision_features(model.model.vision_tower, sample, cfg.vision_feature_std)
            log(f"[{p.name}] vision features rescaled by {c:.4f}")
    t_vision = time.perf_counter() - t1

    # stage 2
    torch.manual_seed(cfg.seed)
    sampler = data.BatchSampler(processor.tokenizer, p.num_image_tokens, bank, seed=cfg.seed, mix=cfg.mix)
    tower = model.model.vision_tower
    tower.requires_grad_(cfg.vision_lr_mult > 0)
    groups = _param_groups(
        [(n, q) for n, q in model.named_parameters() if not n.startswith("model.vision_tower.")],
        cfg.weight_decay,
    )
    for g in groups:
        g["lr_mult"] = 1.0
    if cfg.vision_lr_mult > 0:
        for g in _param_groups(tower.named_parameters(), cfg.weight_decay):
            g["lr_mult"] = cfg.vision_lr_mult
            groups.append(g)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    n_params = sum(q.numel() for q in model.parameters())
    log(f"[{p.name}] stage 2: {n_params / 1e6:.2f} M params, {p.num_image_tokens} image tokens, "
        f"{cfg.steps} steps x {cfg.batch_size}, lr {cfg.lr}")
    n_tasks = len(data.TRAIN_TASKS)
    run_loss, run_n = 0.0, 0
    hits, seen = torch.zeros(n_tasks), torch.zeros(n_tasks)
    t2 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = group["lr_mult"] * cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        batch = sampler.batch(cfg.batch_size)
        loss, correct = answer_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_([q for g in groups for q in g["params"]], cfg.grad_clip)
        opt.step()
        run_loss += loss.item()
        run_n += 1
        hits.index_add_(0, batch["task"], correct.float())
        seen.index_add_(0, batch["task"], torch.ones(len(correct)))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            acc = " ".join(f"{t}={hits[i] / max(1, seen[i]):.2f}" for i, t in enumerate(data.TRAIN_TASKS))
            log(f"[{p.name}] step {step + 1}/{cfg.steps} loss {run_loss / run_n:.4f} "
                f"{acc} {time.perf_counter() - t2:.0f}s")
            run_loss, run_n = 0.0, 0
            hits.zero_()
            seen.zero_()
    model.eval()
    model.requires_grad_(True)
    out = save(model, processor, out_dir)
    wall = time.perf_counter() - t0
    log(f"[{p.name}] saved to {out} (stage 1 {t_vision:.0f}s, stage 2 {time.perf_counter() - t2:.0f}s, "
        f"total {wall:.0f}s)")
    stats = {"name": p.name, "seconds": wall, "path": str(out), "params": n_params}
    if check_n:
        from .evaluate import evaluate

        acc = evaluate(out, n_per_task=check_n)
        log(f"[{p.name}] held-out check ({check_n}/task): "
            + " ".join(f"{k}={100 * v:.0f}%" for k, v in acc.items()))
        low = [k for k, v in acc.items() if v < (0.85 if k == "shape" else 0.98)]
        if low:
            log(f"[{p.name}] WARNING: below target on {low}; run `python -m mmserve.models.demo.evaluate`")
        stats["check"] = acc
    return stats


def train_demo_models(out_root=None, names=("demo", "demo-wide"), log=print) -> list[dict]:
    """Build and train each named demo model into ``checkpoint_dir(name)`` (or out_root/name)."""
    results = []
    bank = None
    vision_cache: dict = {}
    for name in names:
        out = pathlib.Path(out_root) / name if out_root is not None else checkpoint_dir(name)
        cfg = TRAIN_CONFIGS.get(name, TrainConfig())
        p = get_preset(name)
        if bank is None or bank.size != p.image_size or len(bank) != cfg.bank_size:
            t = time.perf_counter()
            bank = data.ImageBank(p.image_size, cfg.bank_size, seed=cfg.seed)
            log(f"rendered {len(bank)} training images in {time.perf_counter() - t:.1f}s")
        results.append(train(name, out, cfg, log=log, bank=bank, vision_cache=vision_cache))
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=["demo", "demo-wide"])
    ap.add_argument("--out", default=None, help="output root (default: the committed checkpoints dir)")
    args = ap.parse_args(argv)
    train_demo_models(args.out, tuple(args.names))


if __name__ == "__main__":
    main()
