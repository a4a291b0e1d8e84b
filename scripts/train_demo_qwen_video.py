"""Teach the committed ``demo-qwen`` two video questions (CPU, deterministic): a third stage over its
trained weights.

``.venv/bin/python scripts/train_demo_qwen_video.py [--out DIR] [--steps N]`` (a script: it reads clips
as the server's intake does, a layer above the demo models)

- "What color is the shape in the video?" (one shape of one colour through the clip) and "Does the
  shape move?" (yes / no), over mp4 clips `render_video` draws and PyAV encodes, read back exactly
  as the server reads them (`inputs.video.decode_video` under the model's own frame sampling at
  `[video] default_fps`, `qwen_video` preprocessing): what the model learns on is what it serves.
- The vision blocks stay frozen (their image features are the image answers'); the merger and the
  text model train on video examples mixed half and half with the image conversations of stage 2
  (the LLaVA demo's tasks at random sizes, training seeds), so the image answers stay as good.
- The chat template gains the video part (``<|vision_start|><|video_pad|><|vision_end|>``);
  image and text prompts render as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import time

import numpy as np
import torch

from mmserve.models.demo import data, render
from mmserve.models.demo.evaluate import TASKS
from mmserve.models.demo.qwen import build_inputs, qwen_checkpoint_dir
from mmserve.models.demo.qwen_evaluate import make_sized_examples
from mmserve.models.demo.render_video import Q_VIDEO_COLOR, Q_VIDEO_MOVES, encode_mp4, render_clip
from mmserve.models.demo.tokenizer import QWEN_CHAT_TEMPLATE

TRAIN_SEED = 7_000_000  # clip seeds from here on; evaluation draws from EVAL_SEED
EVAL_SEED = 9_000_000
SIZES = (48, 64, 80, 96)


def clip_spec(rng: np.random.Generator) -> dict:
    w, h = (int(rng.choice(SIZES)) for _ in range(2))
    return dict(color=render.COLORS[int(rng.integers(len(render.COLORS)))],
                shape=render.SHAPES[int(rng.integers(len(render.SHAPES)))],
                background=render.BACKGROUNDS[int(rng.integers(len(render.BACKGROUNDS)))],
                moves=bool(rng.random() < 0.5), size=(w, h), frames=int(rng.integers(8, 17)), fps=int(rng.integers(4, 9)))


def video_examples(adapter, n: int, seed: int) -> list[tuple[list[dict], object, str]]:
    """[(messages, VideoItem, answer)]: clips drawn, encoded to mp4 and read as the server reads them."""
    from mmserve.config import VideoConfig
    from mmserve.inputs.video import decode_video
    from mmserve.models.video_item import VideoItem, VideoSampling

    cfg = VideoConfig()
    sampling = VideoSampling(fps=cfg.default_fps)
    rng = np.random.default_rng([seed, 0x71DE0])
    out = []
    for k in range(n):
        spec = clip_spec(rng)
        data = encode_mp4(render_clip(spec["color"], spec["shape"], spec["moves"], seed=seed + k, frames=spec["frames"],
                                      size=spec["size"], background=spec["background"]), fps=spec["fps"])
        video = decode_video(data, adapter.video_plan(sampling, cfg.max_frames), cfg, "clip")
        item = VideoItem(video.meta, video.indices, video.content, sampling, (lambda f: lambda: f)(video.frames))
        question, answer = ((Q_VIDEO_MOVES, "yes" if spec["moves"] else "no") if k % 2
                            else (Q_VIDEO_COLOR, spec["color"]))
        out.append(([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}], item, answer))
    return out


def replay_examples(n: int, seed: int) -> list:
    """Stage 2's image conversations (every task), their images re-drawn from training seeds."""
    rng = np.random.default_rng([seed, 0x1A6E])
    out = []
    for task in TASKS:
        for messages, specs, answer in make_sized_examples(task, n // len(TASKS), seed=4242 + seed):
            specs = [dataclasses.replace(s, seed=int(rng.integers(0, data.TRAIN_SEED_LIMIT))) for s in specs]
            out.append((messages, specs, answer))
    return out


def video_inputs(adapter, messages, item) -> dict:
    prompt = adapter.tokenize(messages, [item])
    pixels = adapter.pixel_values([item])[0]
    ids = torch.tensor([prompt.input_ids])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": 2 * (ids == adapter.video_token_id),
            "pixel_values_videos": pixels.patches, "video_grid_thw": torch.tensor([pixels.grid])}


def with_answer(inputs: dict, tokenizer, answer: str) -> dict:
    """The inputs with the answer and EOS appended, labels on them alone."""
    ans = list(tokenizer.encode(" " + answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    n = inputs["input_ids"].shape[1]
    extra = torch.tensor([ans])
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], 1)
    out["labels"] = torch.cat([torch.full((1, n), -100), extra], 1)
    return out


@torch.no_grad()
def video_accuracy(adapter, examples) -> dict[str, float]:
    right = {Q_VIDEO_COLOR: [], Q_VIDEO_MOVES: []}
    for messages, item, answer in examples:
        inputs = video_inputs(adapter, messages, item)
        out = adapter.model.generate(**inputs, max_new_tokens=4, do_sample=False)
        got = adapter.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        right[messages[0]["content"][1]["text"]].append(got == answer)
    return {"video color": float(np.mean(right[Q_VIDEO_COLOR])), "video moves": float(np.mean(right[Q_VIDEO_MOVES]))}


def train(out_dir, steps: int = 300, batch: int = 8, lr: float = 3e-4, n_clips: int = 800, seed: int = 0,
          log=print) -> dict:
    from mmserve.models.loading import load_adapter

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    out = pathlib.Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(qwen_checkpoint_dir("demo-qwen"), out)
    (out / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
    adapter = load_adapter("demo-qwen", out)
    model, tok, ip = adapter.model, adapter.tokenizer, adapter.image_processor
    t0 = time.perf_counter()
    clips = video_examples(adapter, n_clips, TRAIN_SEED)
    log(f"{len(clips)} training clips read in {time.perf_counter() - t0:.0f}s")
    images = replay_examples(n_clips, seed)
    for name, p in model.named_parameters():
        p.requires_grad = not name.startswith("model.visual.") or ".merger." in name
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = np.random.default_rng([seed, 0x3A])
    model.train()
    t1 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.5 + 0.5 * np.cos(np.pi * step / steps))
        opt.zero_grad()
        total = 0.0
        for _ in range(batch):
            if rng.random() < 0.5:
                messages, item, answer = clips[int(rng.integers(len(clips)))]
                inputs = with_answer(video_inputs(adapter, messages, item), tok, answer)
            else:
                messages, specs, answer = images[int(rng.integers(len(images)))]
                inputs = with_answer(build_inputs(tok, ip, messages, [s.render() for s in specs]), tok, answer)
            loss = model(**inputs).loss / batch
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % 25 == 0:
            log(f"step {step + 1}/{steps} loss {total:.4f} {time.perf_counter() - t1:.0f}s")
    model.eval()
    model.save_pretrained(out)
    for extra in out.glob("*.safetensors.index.json"):
        extra.unlink()
    held_out = video_examples(adapter, 120, EVAL_SEED)
    result = video_accuracy(adapter, held_out)
    log(f"held-out video accuracy {result}")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(qwen_checkpoint_dir("demo-qwen")) + "-video")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    train(args.out, steps=args.steps)


if __name__ == "__main__":
    main()
