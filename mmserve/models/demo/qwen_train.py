"""Train the Qwen2-VL demo checkpoint ``demo-qwen`` from scratch (CPU, deterministic).

``python -m mmserve.models.demo.qwen_train [--out DIR]`` or ``mmserve train-demo demo-qwen``.

The recipe is the LLaVA demo's (:mod:`.train`, whose docstring says why), adapted to Qwen2-VL:

1. **Vision pre-training**: patch embedding + ViT blocks, with throw-away linear heads on each
   image's mean-pooled block output, learn shape, colour and background on images of many sizes.
   No feature rescaling is needed: the merger (Qwen's projector) starts with a LayerNorm.
2. **Language training** with the blocks frozen: merger + text model on chat conversations, loss
   on the final answer and ``</s>`` only. Frozen blocks give the same output for an image every
   time, so they run once over the whole bank and the steps start from those cached features;
   the merger, the scatter into the embeddings, M-RoPE positions (``get_rope_index`` with the
   real ``mm_token_type_ids`` / ``image_grid_thw``) and the text model are the model's own.

Deterministic (seeded, fixed thread count): a re-run gives byte-identical weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

from . import data, render
from .qwen import build_image_processor, build_qwen_model, get_qwen_preset, qwen_checkpoint_dir, save_qwen
from .qwen_data import BatchSampler, ImageBank
from .tokenizer import build_qwen_tokenizer
from .train import _param_groups, cosine_lr


@dataclasses.dataclass(frozen=True)
class QwenTrainConfig:
    # stage 1: vision pre-training
    vision_steps: int = 1500
    vision_batch_size: int = 64
    vision_lr: float = 2e-3
    vision_warmup: int = 200
    vision_pool_queries: int = 0  # 0: heads read each image's mean feature; n: n learned attention queries
    # stage 2: merger + text model
    steps: int = 1200
    batch_size: int = 48
    lr: float = 1.5e-3
    merger_lr_mult: float = 1.0  # the merger's learning rate (x lr)
    min_lr_frac: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bank_size: int = 16000
    seed: int = 0
    threads: int = 2
    log_every: int = 100
    mix: data.TaskMix = dataclasses.field(default_factory=data.TaskMix)


QWEN_TRAIN_CONFIGS: dict[str, QwenTrainConfig] = {"demo-qwen": QwenTrainConfig()}


def _segments(grid_thw: torch.Tensor) -> torch.Tensor:
    """Image index of every patch row (the vision tower's rows are images back to back)."""
    return torch.repeat_interleave(torch.arange(len(grid_thw)), grid_thw.prod(-1))


class AttentionPool(torch.nn.Module):
    """Per image, ``n`` learned queries attend over its patch features (softmax within the image)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.query = torch.nn.Parameter(torch.zeros(n, dim))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, hidden: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        n = grid.prod(-1)
        batch, length = len(n), int(n.max())
        seg = _segments(grid)
        dest = seg * length + torch.arange(len(hidden)) - (torch.cumsum(n, 0) - n)[seg]
        valid = torch.zeros(batch * length, dtype=torch.bool)
        valid[dest] = True
        padded = hidden.new_zeros(batch * length, hidden.shape[1]).index_copy(0, dest, hidden)
        padded = padded.view(batch, length, -1)
        scores = self.norm(padded) @ self.query.t() / hidden.shape[1] ** 0.5  # [B, L, n]
        weights = scores.masked_fill(~valid.view(batch, length, 1), float("-inf")).softmax(1)
        return torch.einsum("bln,bld->bnd", weights, padded).reshape(batch, -1)


def pretrain_vision(visual, bank: ImageBank, cfg: QwenTrainConfig, log=print) -> None:
    """Train ``visual``'s patch embedding and blocks as a shape/colour/background classifier, in place."""
    torch.manual_seed(cfg.seed + 1)
    dim = visual.config.embed_dim
    nq = cfg.vision_pool_queries
    pool = AttentionPool(dim, nq) if nq else None
    heads = torch.nn.ModuleDict({
        "shape": torch.nn.Linear(dim * max(1, nq), len(render.SHAPES)),
        "color": torch.nn.Linear(dim * max(1, nq), len(render.COLORS)),
        "background": torch.nn.Linear(dim * max(1, nq), len(render.BACKGROUNDS)),
    })
    labels = {
        "shape": torch.tensor([render.SHAPES.index(s.shape) for s in bank.specs]),
        "color": torch.tensor([render.COLORS.index(s.color) for s in bank.specs]),
        "background": torch.tensor([render.BACKGROUNDS.index(s.background) for s in bank.specs]),
    }
    params = [(n, q) for n, q in visual.named_parameters() if not n.startswith("merger.")]
    params += list(heads.named_parameters()) + (list(pool.named_parameters()) if pool else [])
    opt = torch.optim.AdamW(_param_groups(params, cfg.weight_decay), lr=cfg.vision_lr)
    rng = np.random.default_rng([cfg.seed, 0x51715])
    visual.train()
    t0 = time.perf_counter()
    run = {"loss": 0.0, "shape": 0.0, "n": 0}
    for step in range(cfg.vision_steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.vision_steps, cfg.vision_lr, cfg.vision_warmup, cfg.min_lr_frac)
        idx = torch.from_numpy(rng.integers(len(bank), size=cfg.vision_batch_size))
        grid = bank.grids[idx]
        hidden = visual(bank.pixel_values(idx.tolist()), grid_thw=grid).last_hidden_state
        if pool is not None:
            feat = pool(hidden, grid)
        else:
            feat = torch.zeros(len(idx), dim).index_add_(0, _segments(grid), hidden) / grid.prod(-1, keepdim=True)
        loss = 0.0
        for k, head in heads.items():
            logits = head(feat)
            loss = loss + F.cross_entropy(logits, labels[k][idx])
            if k == "shape":
                run["shape"] += (logits.argmax(-1) == labels[k][idx]).float().mean().item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run["loss"] += loss.item()
        run["n"] += 1
        if (step + 1) % (2 * cfg.log_every) == 0 or step + 1 == cfg.vision_steps:
            log(f"  vision step {step + 1}/{cfg.vision_steps} loss {run['loss'] / run['n']:.4f} "
                f"shape-acc {run['shape'] / run['n']:.3f} {time.perf_counter() - t0:.0f}s")
            run = {"loss": 0.0, "shape": 0.0, "n": 0}
    visual.eval()
    return heads, pool


@torch.no_grad()
def block_features(visual, bank: ImageBank, chunk: int = 256) -> torch.Tensor:
    """The frozen blocks' output (the merger's input) for every bank image, rows as in the bank."""
    out = []
    for k in range(0, len(bank), chunk):
        idx = list(range(k, min(k + chunk, len(bank))))
        out.append(visual(bank.pixel_values(idx), grid_thw=bank.grids[idx]).last_hidden_state)
    return torch.cat(out)


def answer_loss(model, batch: dict[str, torch.Tensor], image_embeds: torch.Tensor):
    """Cross-entropy on the labelled positions; returns (loss, first-answer-token correctness)."""
    inner = model.model
    ids = batch["input_ids"]
    embeds = inner.get_input_embeddings()(ids)
    mask = (ids == model.config.image_token_id).unsqueeze(-1)
    embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
    # explicit positions: model.model.rope_deltas is instance state that generate() leaves behind
    position_ids, _ = inner.get_rope_index(
        ids, mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    hidden = inner.language_model(
        inputs_embeds=embeds, position_ids=position_ids, attention_mask=batch["attention_mask"], use_cache=False,
    ).last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    labelled = targets != -100
    logits = model.lm_head(hidden[labelled])
    tgt = targets[labelled]
    loss = F.cross_entropy(logits, tgt)
    counts = labelled.sum(1)
    first = torch.cumsum(counts, 0) - counts
    return loss, logits[first].argmax(-1) == tgt[first]


def train(preset="demo-qwen", out_dir=None, cfg: QwenTrainConfig | None = None, log=print, check_n: int = 60) -> dict:
    """Build ``preset`` from scratch, train it, save to out_dir. Returns a small stats dict."""
    p = get_qwen_preset(preset)
    cfg = cfg or QWEN_TRAIN_CONFIGS.get(p.name, QwenTrainConfig())
    out_dir = qwen_checkpoint_dir(p.name) if out_dir is None else out_dir
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    bank = ImageBank(p, cfg.bank_size, seed=cfg.seed)
    log(f"[{p.name}] rendered {len(bank)} training images ({bank.patches.shape[0]} patches, "
        f"{min(bank.tokens)}..{max(bank.tokens)} tokens/image) in {time.perf_counter() - t0:.1f}s")
    tokenizer = build_qwen_tokenizer()
    model = build_qwen_model(p, tokenizer, seed=cfg.seed)
    visual = model.model.visual

    t1 = time.perf_counter()
    if cfg.vision_steps > 0:
        log(f"[{p.name}] stage 1: vision pre-training ({cfg.vision_steps} steps x {cfg.vision_batch_size})")
        pretrain_vision(visual, bank, cfg, log=log)
    features = block_features(visual, bank)
    t_vision = time.perf_counter() - t1
    log(f"[{p.name}] block features of the bank cached ({tuple(features.shape)}) {t_vision:.0f}s")

    # stage 2
    torch.manual_seed(cfg.seed)
    sampler = BatchSampler(tokenizer, bank, seed=cfg.seed, mix=cfg.mix)
    for name, q in model.named_parameters():
        q.requires_grad_(not name.startswith("model.visual.") or name.startswith("model.visual.merger."))
    trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    groups = []
    for mult, part in ((1.0, [(n, q) for n, q in trainable if ".merger." not in n]),
                       (cfg.merger_lr_mult, [(n, q) for n, q in trainable if ".merger." in n])):
        for g in _param_groups(part, cfg.weight_decay):
            groups.append({**g, "lr_mult": mult})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    n_params = sum(q.numel() for q in model.parameters())
    log(f"[{p.name}] stage 2: {n_params / 1e6:.2f} M params, {cfg.steps} steps x {cfg.batch_size}, lr {cfg.lr}")
    n_tasks = len(data.TRAIN_TASKS)
    run_loss, run_n = 0.0, 0
    hits, seen = torch.zeros(n_tasks), torch.zeros(n_tasks)
    t2 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = group["lr_mult"] * cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        batch = sampler.batch(cfg.batch_size)
        image_embeds = visual.merger(features[bank.patch_index(batch["image_index"].tolist())])
        loss, correct = answer_loss(model, batch, image_embeds)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_([q for _, q in trainable], cfg.grad_clip)
        opt.step()
        run_loss += loss.item()
        run_n += 1
        hits.index_add_(0, batch["task"], correct.float())
        seen.index_add_(0, batch["task"], torch.ones(len(correct)))
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            acc = " ".join(f"{t}={hits[i] / max(1, seen[i]):.2f}" for i, t in enumerate(data.TRAIN_TASKS))
            rms = image_embeds.detach().pow(2).mean().sqrt().item()
            log(f"[{p.name}] step {step + 1}/{cfg.steps} loss {run_loss / run_n:.4f} "
                f"{acc} image-rms {rms:.2f} {time.perf_counter() - t2:.0f}s")
            run_loss, run_n = 0.0, 0
            hits.zero_()
            seen.zero_()
    model.eval()
    model.requires_grad_(True)
    out = save_qwen(model, tokenizer, build_image_processor(p), out_dir)
    wall = time.perf_counter() - t0
    log(f"[{p.name}] saved to {out} (stage 1 {t_vision:.0f}s, stage 2 {time.perf_counter() - t2:.0f}s, "
        f"total {wall:.0f}s)")
    stats = {"name": p.name, "seconds": wall, "path": str(out), "params": n_params}
    if check_n:
        from .qwen_evaluate import evaluate

        acc = evaluate(out, n_per_task=check_n)
        log(f"[{p.name}] held-out check ({check_n}/task): "
            + " ".join(f"{k}={100 * v:.0f}%" for k, v in acc.items()))
        low = [k for k, v in acc.items() if v < (0.85 if k == "shape" else 0.98)]
        if low:
            log(f"[{p.name}] WARNING: below target on {low}; run `python -m mmserve.models.demo.qwen_evaluate`")
        stats["check"] = acc
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default: the committed checkpoint)")
    ap.add_argument("--no-check", action="store_true", help="skip the held-out check after training")
    args = ap.parse_args(argv)
    train("demo-qwen", args.out, check_n=0 if args.no_check else 60)


if __name__ == "__main__":
    main()
