"""Held-out accuracy of a demo checkpoint, with HF ``model.generate`` (greedy).

``python -m mmserve.models.demo.evaluate PATH [PATH ...] [--n 60] [--seed 12345]``

Tasks (images are freshly rendered with seeds disjoint from the training seeds):

- ``color`` / ``background`` / ``shape``: one image, one question.
- ``first`` / ``second``: two images (different colours) in one user message.
- ``second_turn``: a two-turn conversation (image(s) only in the first user turn, the first answer
  in the history), scored on the final, different question. Half single-image, half two-image.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections import defaultdict

import numpy as np
import torch

from . import data, render

TASKS = ("color", "background", "shape", "first", "second", "second_turn")


def _eval_seed(rng: np.random.Generator) -> int:
    return data.EVAL_SEED_BASE + int(rng.integers(0, 1 << 30))


def _spec(rng, color=None, shape=None, background=None) -> data.ImageSpec:
    return data.ImageSpec(
        color=color or render.COLORS[int(rng.integers(len(render.COLORS)))],
        shape=shape or render.SHAPES[int(rng.integers(len(render.SHAPES)))],
        background=background or render.BACKGROUNDS[int(rng.integers(len(render.BACKGROUNDS)))],
        seed=_eval_seed(rng),
    )


def _pair(rng, i: int, which: int) -> list[data.ImageSpec]:
    """Two images with different colours; the asked one (index `which`) cycles through COLORS."""
    asked = render.COLORS[i % len(render.COLORS)]
    others = [c for c in render.COLORS if c != asked]
    other = others[int(rng.integers(len(others)))]
    a, b = _spec(rng, color=asked), _spec(rng, color=other)
    return [a, b] if which == 0 else [b, a]


def make_examples(task: str, n: int, seed: int = 12345) -> list[tuple[list[dict], list, str]]:
    """[(messages, specs, answer)]: balanced over the asked attribute's values."""
    rng = np.random.default_rng([seed, TASKS.index(task)])
    out = []
    for i in range(n):
        if task == "color":
            specs = [_spec(rng, color=render.COLORS[i % len(render.COLORS)])]
            msgs, ans = data.conversation(render.Q_COLOR, specs)
        elif task == "background":
            specs = [_spec(rng, background=render.BACKGROUNDS[i % len(render.BACKGROUNDS)])]
            msgs, ans = data.conversation(render.Q_BACKGROUND, specs)
        elif task == "shape":
            specs = [_spec(rng, shape=render.SHAPES[i % len(render.SHAPES)])]
            msgs, ans = data.conversation(render.Q_SHAPE, specs)
        elif task in ("first", "second"):
            which = 0 if task == "first" else 1
            specs = _pair(rng, i, which)
            msgs, ans = data.conversation(render.Q_FIRST if which == 0 else render.Q_SECOND, specs)
        elif task == "second_turn":
            if i % 2 == 0:
                qs = list(data.SINGLE_QUESTIONS)
                j = int(rng.integers(3))
                final = qs[(i // 2) % 3]
                first = [q for q in qs if q != final][j % 2]
                specs = [_spec(rng)]
            else:
                which = int(rng.integers(2))
                specs = _pair(rng, i // 2, which)
                final = data.PAIR_QUESTIONS[which]
                first = data.PAIR_QUESTIONS[1 - which]
            msgs, ans = data.conversation(final, specs, history=(first,))
        else:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        out.append((msgs, specs, ans))
    return out


def load(checkpoint_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint_path)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint_path)
    model.eval()
    return model, processor


@torch.no_grad()
def generate_answers(model, processor, examples, batch_size: int = 32, max_new_tokens: int = 4) -> list[str]:
    """Greedy answers (stripped). Prompts are batched only with prompts of equal length (no padding)."""
    prompts = []
    for msgs, specs, _ in examples:
        text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        images = [s.render() for s in specs]
        prompts.append((text, images))
    lengths = [(len(processor.tokenizer.encode(t, add_special_tokens=False)), len(ims)) for t, ims in prompts]
    by_len: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        by_len[n].append(i)
    answers: list[str] = [""] * len(prompts)
    for idxs in by_len.values():
        for k in range(0, len(idxs), batch_size):
            chunk = idxs[k : k + batch_size]
            inputs = processor(
                text=[prompts[i][0] for i in chunk],
                images=[im for i in chunk for im in prompts[i][1]],
                return_tensors="pt",
            )
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            new = out[:, inputs["input_ids"].shape[1] :]
            for i, row in zip(chunk, new):
                answers[i] = processor.tokenizer.decode(row, skip_special_tokens=True).strip()
    return answers


def evaluate(checkpoint_path, n_per_task: int = 60, seed: int = 12345, tasks=TASKS, model_and_processor=None) -> dict[str, float]:
    """Accuracy per task (exact match of the stripped greedy answer)."""
    model, processor = model_and_processor or load(checkpoint_path)
    result = {}
    for task in tasks:
        examples = make_examples(task, n_per_task, seed)
        answers = generate_answers(model, processor, examples)
        result[task] = sum(a == ex[2] for a, ex in zip(answers, examples)) / len(examples)
    return result


def format_table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    width = max(12, *(len(n) + 2 for n in names))
    lines = ["task".ljust(14) + "".join(n.rjust(width) for n in names)]
    tasks = list(next(iter(results.values())))
    for t in tasks:
        lines.append(t.ljust(14) + "".join(f"{100 * results[n][t]:.1f}%".rjust(width) for n in names))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="checkpoint directories (or demo names: demo, demo-wide)")
    ap.add_argument("--n", type=int, default=60, help="examples per task")
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args(argv)
    from .build import checkpoint_dir

    results = {}
    for p in args.paths:
        path = pathlib.Path(p)
        if not path.exists() and (checkpoint_dir(p)).exists():
            path = checkpoint_dir(p)
        t = time.perf_counter()
        results[p] = evaluate(path, n_per_task=args.n, seed=args.seed)
        print(f"{p}: evaluated in {time.perf_counter() - t:.1f}s")
    print(format_table(results))


if __name__ == "__main__":
    main()
