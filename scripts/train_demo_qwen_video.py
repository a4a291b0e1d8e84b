"""Teach the image-trained ``demo-qwen`` two video questions (CPU, seeded): its third stage.

``.venv/bin/python scripts/train_demo_qwen_video.py --base DIR [--out DIR]``: ``--base`` is the
checkpoint of stages 1-2 (``mmserve train-demo demo-qwen --out ROOT`` writes ``ROOT/demo-qwen``);
``--out`` defaults to the committed ``mmserve/models/demo/checkpoints/demo-qwen``. 3 minutes on 2
quiet cores (18 on this VM shared with four other jobs). A script, not a module of
``mmserve.models.demo``: it reads clips as the server's intake does (``mmserve.inputs.video``, a
layer above the demo models).

- "What color is the shape in the video?" (one shape of one colour through the clip) and "Does the
  shape move?" (``yes`` / ``no``: three tokens each in the demo BPE, `` y`` `e` `s` / `` `` `n` `o``,
  all labelled), over mp4 clips ``render_video`` draws (a moving shape crosses the frame) and PyAV
  encodes, read back exactly as the server reads them (``decode_video`` under the model's frame
  sampling at several request settings, ``qwen_video`` preprocessing): what it learns on is what it
  serves. Half the clips move.
- Why motion is visible at all: Qwen2-VL's vision tower attends within one temporal patch (two
  sampled frames) at a time, and its patch embedding (a Conv3d over those two frames) was trained on
  images, whose two frames are equal, so only the *sum* of its two temporal kernels was ever learnt.
  This stage trains their *difference* alone (a zero-mean change along the temporal axis,
  :class:`TemporalDifference`): it turns what changed between the two frames into a feature, and an
  image (its frame repeated) multiplies it by zero — the vision tower's image outputs stay as they
  are (to float rounding). The blocks and the merger stay frozen.
- The text model and LM head train on the video questions mixed with stage 2's image conversations
  (the cached block features of a fresh bank of training images, every task), so the image answers
  stay as good.
- A ``video_stage.json`` beside the weights records the stage's settings and held-out figures; a
  base that has one is refused (the stage starts from image-trained weights). Seeded throughout,
  but not byte-identical from one process to the next: FFmpeg's libx264 does not encode the same
  frames to the same bytes in two processes (tests/image_server.py works around the same), so the
  decoded training clips differ by compression noise; re-runs land near the committed figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from mmserve.config import VideoConfig
from mmserve.inputs.video import decode_video
from mmserve.models.demo import render
from mmserve.models.demo.qwen import get_qwen_preset, qwen_checkpoint_dir
from mmserve.models.demo.qwen_data import BatchSampler, ImageBank
from mmserve.models.demo.qwen_train import answer_loss, block_features
from mmserve.models.demo.render_video import Q_VIDEO_COLOR, Q_VIDEO_MOVES, encode_mp4, render_clip
from mmserve.models.demo.train import cosine_lr
from mmserve.models.loading import load_adapter
from mmserve.models.qwen_video import resized_size, video_patches
from mmserve.models.video_item import VideoItem, VideoSampling

TRAIN_SEED = 7_000_000  # clip seeds from here on; held-out clips (and the tests') from EVAL_SEED
EVAL_SEED = 9_000_000
MARKER = "video_stage.json"
# request settings the clips are read under: the server's default rate and what callers send
SAMPLINGS = (VideoSampling(), VideoSampling(fps=4), VideoSampling(fps=1), VideoSampling(fps=3),
             VideoSampling(num_frames=8))
QUESTIONS = (Q_VIDEO_COLOR, Q_VIDEO_MOVES)


@dataclasses.dataclass(frozen=True)
class VideoStageConfig:
    delta_steps: int = 150  # phase 1: the patch embedding's temporal difference
    steps: int = 450  # phase 2: the text model
    video_batch: int = 16
    image_batch: int = 24
    lr: float = 1e-3  # text model and LM head
    delta_lr: float = 5e-3  # the patch embedding's temporal difference (and its throw-away head)
    warmup: int = 30
    min_lr_frac: float = 0.05
    clips: int = 1200
    bank_size: int = 3000  # replayed training images (stage 2's tasks)
    seed: int = 0
    threads: int = 2


@dataclasses.dataclass(frozen=True)
class ClipSpec:
    color: str
    shape: str
    background: str
    moves: bool
    size: tuple[int, int]
    frames: int
    fps: int
    sampling: VideoSampling
    seed: int

    def mp4(self) -> bytes:
        return encode_mp4(render_clip(self.color, self.shape, self.moves, seed=self.seed, frames=self.frames,
                                      size=self.size, background=self.background), fps=self.fps)


def clip_specs(n: int, seed: int) -> list[ClipSpec]:
    """n clips, every other one moving; colour, shape, background, size, length and sampling drawn."""
    rng = np.random.default_rng([seed, 0x71DE0])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    return [ClipSpec(pick(render.COLORS), pick(render.SHAPES), pick(render.BACKGROUNDS), k % 2 == 1,
                     (2 * int(rng.integers(24, 65)), 2 * int(rng.integers(24, 65))), int(rng.integers(8, 25)),
                     int(rng.integers(4, 13)), pick(SAMPLINGS), seed + k) for k in range(n)]


def answer(spec: ClipSpec, question: str) -> str:
    return spec.color if question == Q_VIDEO_COLOR else ("yes" if spec.moves else "no")


def read_clip(adapter, spec: ClipSpec, cfg: VideoConfig) -> VideoItem:
    """The clip as the server's intake reads it (its default rate filled in when none is asked)."""
    sampling = spec.sampling
    if sampling.fps is None and sampling.num_frames is None:
        sampling = dataclasses.replace(sampling, fps=cfg.default_fps)
    video = decode_video(spec.mp4(), adapter.video_plan(sampling, cfg.max_frames), cfg, "clip")
    frames = video.frames
    return VideoItem(video.meta, video.indices, video.content, sampling, lambda: frames)


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]


class Clip:
    """One training clip: its frames resized as the processor resizes them (uint8: small; its patches
    are made per batch by the server's own `video_patches`), grid and prompt per question."""

    def __init__(self, adapter, spec: ClipSpec, cfg: VideoConfig):
        item = read_clip(adapter, spec, cfg)
        s = adapter.video_settings
        self.resized = resized_size(item.meta.height, item.meta.width, len(item.indices), item.sampling, s)
        video = torch.from_numpy(item.frames()).permute(0, 3, 1, 2)
        if tuple(video.shape[-2:]) != tuple(self.resized):
            video = F.interpolate(video, size=self.resized, mode="bicubic", antialias=True, align_corners=False)
        self.frames = video.permute(0, 2, 3, 1).contiguous().numpy()
        self.grid = adapter.item_grid(item)
        self.embeds = None  # the frozen vision tower's output, once it is frozen
        self.prompts = {q: list(adapter.tokenize(messages(q), [item]).input_ids) for q in QUESTIONS}
        self.spec = spec

    def patches(self, settings) -> torch.Tensor:
        return video_patches(self.frames, self.resized, settings)

    @torch.no_grad()
    def encode(self, visual, settings) -> None:
        self.embeds = visual(self.patches(settings), grid_thw=torch.tensor([self.grid])).pooler_output


class TemporalDifference(torch.nn.Module):
    """A Conv3d weight plus a trained change that sums to zero along its temporal axis: a frame
    repeated over the temporal patch (every image) meets none of it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.zeros_like(weight))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.delta - self.delta.mean(2, keepdim=True))


def video_batch(clips: list[Clip], picks, rng, tokenizer, settings) -> dict[str, torch.Tensor]:
    """Right-padded inputs, labels on the answer + ``</s>``, video patches and grids."""
    rows = []
    for i in picks:
        clip = clips[int(i)]
        q = QUESTIONS[int(rng.integers(2))]
        ans = list(tokenizer.encode(" " + answer(clip.spec, q), add_special_tokens=False)) + [tokenizer.eos_token_id]
        rows.append((clip.prompts[q], ans))
    n = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), n), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for r, (p, a) in enumerate(rows):
        ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        labels[r, len(p): len(p) + len(a)] = torch.tensor(a)
        mask[r, : len(p) + len(a)] = 1
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "mm_token_type_ids": (ids == video_id).to(torch.int) * 2,
            **({"video_embeds": torch.cat([clips[int(i)].embeds for i in picks])} if clips[int(picks[0])].embeds is not None
               else {"pixel_values_videos": torch.cat([clips[int(i)].patches(settings) for i in picks])}),
            "video_grid_thw": torch.tensor([clips[int(i)].grid for i in picks])}


def video_loss(model, batch: dict[str, torch.Tensor]):
    """Cross-entropy on the labelled positions through the whole model (the vision tower's blocks
    frozen); returns (loss, first-answer-token correctness)."""
    inner = model.model
    ids = batch["input_ids"]
    video_embeds = batch.get("video_embeds")
    if video_embeds is None:
        video_embeds = inner.visual(batch["pixel_values_videos"], grid_thw=batch["video_grid_thw"]).pooler_output
    embeds = inner.get_input_embeddings()(ids)
    embeds = embeds.masked_scatter((ids == model.config.video_token_id).unsqueeze(-1), video_embeds)
    position_ids, _ = inner.get_rope_index(ids, mm_token_type_ids=batch["mm_token_type_ids"],
                                           video_grid_thw=batch["video_grid_thw"],
                                           attention_mask=batch["attention_mask"])
    hidden = inner.language_model(inputs_embeds=embeds, position_ids=position_ids,
                                  attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state[:, :-1]
    targets = batch["labels"][:, 1:]
    labelled = targets != -100
    logits = model.lm_head(hidden[labelled])
    tgt = targets[labelled]
    counts = labelled.sum(1)
    first = torch.cumsum(counts, 0) - counts
    return F.cross_entropy(logits, tgt), logits[first].argmax(-1) == tgt[first]


@torch.no_grad()
def video_accuracy(adapter, specs: list[ClipSpec], cfg: VideoConfig) -> dict[str, tuple[int, int]]:
    """(right, asked) per question, HF ``generate`` greedy on the server's inputs of each clip."""
    out = {q: [0, 0] for q in QUESTIONS}
    for spec in specs:
        item = read_clip(adapter, spec, cfg)
        pixels = adapter.pixel_values([item])[0]
        for q in QUESTIONS:
            ids = torch.tensor([adapter.tokenize(messages(q), [item]).input_ids])
            gen = adapter.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         mm_token_type_ids=(ids == adapter.video_token_id).to(torch.int) * 2,
                                         pixel_values_videos=pixels.patches, video_grid_thw=torch.tensor([pixels.grid]),
                                         max_new_tokens=4, do_sample=False)
            got = adapter.tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
            out[q][0] += got == answer(spec, q)
            out[q][1] += 1
    return {q: tuple(v) for q, v in out.items()}


def train_temporal_difference(visual, clips: list[Clip], settings, cfg: "VideoStageConfig", log=print) -> None:
    """Phase 1: the patch embedding's temporal difference (blocks and merger frozen) learns, with a
    throw-away head on its merged tokens, whether the shape moves; in place."""
    proj = visual.patch_embed.proj
    parametrize.register_parametrization(proj, "weight", TemporalDifference(proj.weight))
    delta = proj.parametrizations.weight[0].delta
    # per merged token, then averaged (as the text model can read it: an MLP at each video token, then
    # attention over them); a linear read of the mean would not do: the leading and trailing edges
    # of a moving shape change the frames by opposite amounts
    width = visual.merger.mlp[-1].out_features
    head = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW([delta, *head.parameters()], lr=cfg.delta_lr, weight_decay=0.0)
    rng = np.random.default_rng([cfg.seed, 0xD1FF])
    t0, run = time.perf_counter(), [0.0, 0.0, 0]
    for step in range(cfg.delta_steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.delta_steps, cfg.delta_lr, cfg.warmup, cfg.min_lr_frac)
        picks = [clips[int(i)] for i in rng.integers(len(clips), size=cfg.video_batch)]
        grid = torch.tensor([c.grid for c in picks])
        merged = visual(torch.cat([c.patches(settings) for c in picks]), grid_thw=grid).pooler_output
        n = grid.prod(-1) // visual.spatial_merge_size**2
        logits = torch.zeros(len(picks), 2).index_add_(0, torch.repeat_interleave(torch.arange(len(picks)), n),
                                                       head(merged)) / n.unsqueeze(1)
        target = torch.tensor([int(c.spec.moves) for c in picks])
        loss = F.cross_entropy(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run[0] += loss.item()
        run[1] += (logits.argmax(-1) == target).float().mean().item()
        run[2] += 1
        if (step + 1) % 25 == 0 or step + 1 == cfg.delta_steps:
            log(f"temporal difference step {step + 1}/{cfg.delta_steps} loss {run[0] / run[2]:.4f} "
                f"moves-acc {run[1] / run[2]:.3f} {time.perf_counter() - t0:.0f}s")
            run = [0.0, 0.0, 0]
    parametrize.remove_parametrizations(proj, "weight", leave_parametrized=True)


def train(base, out, cfg: VideoStageConfig = VideoStageConfig(), log=print, eval_clips: int = 60) -> dict:
    base, out = pathlib.Path(base), pathlib.Path(out)
    if (base / MARKER).exists():
        raise SystemExit(f"{base} is already video-trained ({MARKER}); pass the image-trained checkpoint "
                         "(`mmserve train-demo demo-qwen --out ROOT`: ROOT/demo-qwen)")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    adapter = load_adapter("demo-qwen", base)
    model, tok, vcfg = adapter.model, adapter.tokenizer, VideoConfig()
    visual, settings = model.model.visual, adapter.video_settings
    for q in model.parameters():
        q.requires_grad_(False)
    clips = [Clip(adapter, spec, vcfg) for spec in clip_specs(cfg.clips, TRAIN_SEED)]
    bank = ImageBank(get_qwen_preset("demo-qwen"), cfg.bank_size, seed=cfg.seed + 1)
    features = block_features(visual, bank)  # the blocks' image outputs: the temporal difference leaves them
    sampler = BatchSampler(tok, bank, seed=cfg.seed + 1)
    log(f"{len(clips)} clips read, {len(bank)} replay images encoded in {time.perf_counter() - t0:.0f}s")
    train_temporal_difference(visual, clips, settings, cfg, log)
    for clip in clips:  # phase 2 reads the vision tower's (now frozen) outputs
        clip.encode(visual, settings)

    # phase 2: the text model and LM head on video questions and replayed image conversations
    text = [q for n, q in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))]
    for q in text:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(text, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = np.random.default_rng([cfg.seed, 0x3A])
    model.train()
    t1 = time.perf_counter()
    run = {"video": 0.0, "image": 0.0, "first": 0.0, "n": 0}
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_frac)
        vloss, first = video_loss(model, video_batch(clips, rng.integers(len(clips), size=cfg.video_batch), rng,
                                                     tok, settings))
        batch = sampler.batch(cfg.image_batch)
        iloss, _ = answer_loss(model, batch, visual.merger(features[bank.patch_index(batch["image_index"].tolist())]))
        opt.zero_grad(set_to_none=True)
        (vloss + iloss).backward()
        torch.nn.utils.clip_grad_norm_(text, 1.0)
        opt.step()
        run["video"] += vloss.item()
        run["image"] += iloss.item()
        run["first"] += first.float().mean().item()
        run["n"] += 1
        if (step + 1) % 25 == 0 or step + 1 == cfg.steps:
            n = run.pop("n")
            log(f"step {step + 1}/{cfg.steps} " + " ".join(f"{k} {v / n:.4f}" for k, v in run.items())
                + f" {time.perf_counter() - t1:.0f}s")
            run = {k: 0.0 for k in run} | {"n": 0}
    model.eval()
    model.requires_grad_(True)
    if out != base:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(base, out)
    model.save_pretrained(out)
    for extra in out.glob("*.safetensors.index.json"):
        extra.unlink()
    wall = time.perf_counter() - t0
    stats = {"stage": "video", "config": dataclasses.asdict(cfg), "train_seed": TRAIN_SEED, "seconds": round(wall)}
    if eval_clips:
        got = video_accuracy(adapter, clip_specs(eval_clips, EVAL_SEED), vcfg)
        stats["held_out"] = {q: f"{r}/{n}" for q, (r, n) in got.items()}
        log(f"held-out clips (seeds from {EVAL_SEED}): {stats['held_out']}")
    (out / MARKER).write_text(json.dumps({k: v for k, v in stats.items() if k != "seconds"}, indent=1,
                                         default=str) + "\n")
    log(f"saved to {out} in {wall:.0f}s")
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the image-trained demo-qwen (stages 1-2)")
    ap.add_argument("--out", default=str(qwen_checkpoint_dir("demo-qwen")))
    ap.add_argument("--steps", type=int, default=VideoStageConfig.steps)
    ap.add_argument("--eval-clips", type=int, default=60)
    args = ap.parse_args(argv)
    train(args.base, args.out, dataclasses.replace(VideoStageConfig(), steps=args.steps), eval_clips=args.eval_clips)


if __name__ == "__main__":
    main()
