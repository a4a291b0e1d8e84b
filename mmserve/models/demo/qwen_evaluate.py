"""Held-out accuracy of a Qwen2-VL demo checkpoint, with HF ``model.generate`` (greedy).

``python -m mmserve.models.demo.qwen_evaluate [PATH ...] [--n 60] [--seed 12345]`` (default: the
committed ``demo-qwen``).

The tasks and conversations are the LLaVA demo's (:func:`.evaluate.make_examples`); every image
additionally gets its own held-out size (sides 32..128 px, aspect up to 3:1), so prompts hold
different numbers of image tokens. Inputs are built by hand (:func:`.qwen.build_inputs`: the
tokenizer, ``Qwen2VLImageProcessorPil``, pads expanded, ``mm_token_type_ids``) and batched with
left padding.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch

from .evaluate import TASKS, format_table, make_examples
from .qwen import build_inputs, qwen_checkpoint_dir
from .qwen_data import random_size, with_size


def make_sized_examples(task: str, n: int, seed: int = 12345):
    """[(messages, specs, answer)] of :func:`.evaluate.make_examples`, images at random sizes."""
    rng = np.random.default_rng([seed, TASKS.index(task), 0x517E])
    return [(msgs, [with_size(s, random_size(rng)) for s in specs], ans)
            for msgs, specs, ans in make_examples(task, n, seed)]


def load(path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, tokenizer, image_processor


def collate_left(inputs: list[dict], pad_id: int) -> dict:
    """One batch of :func:`.qwen.build_inputs` outputs, left-padded (what generation wants)."""
    n = max(x["input_ids"].shape[1] for x in inputs)
    out = {k: torch.zeros(len(inputs), n, dtype=torch.long) for k in ("attention_mask", "mm_token_type_ids")}
    out["input_ids"] = torch.full((len(inputs), n), pad_id, dtype=torch.long)
    for i, x in enumerate(inputs):
        m = x["input_ids"].shape[1]
        for k in ("input_ids", "attention_mask", "mm_token_type_ids"):
            out[k][i, n - m :] = x[k][0]
    with_images = [x for x in inputs if "pixel_values" in x]
    if with_images:
        out["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images])
        out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in with_images])
    return out


@torch.no_grad()
def generate_answers(model, tokenizer, image_processor, examples, batch_size: int = 16,
                     max_new_tokens: int = 4) -> list[str]:
    """Greedy answers (stripped), prompts of similar length batched together."""
    inputs = [build_inputs(tokenizer, image_processor, msgs, [s.render() for s in specs])
              for msgs, specs, _ in examples]
    order = sorted(range(len(inputs)), key=lambda i: inputs[i]["input_ids"].shape[1])
    answers = [""] * len(inputs)
    for k in range(0, len(order), batch_size):
        chunk = order[k : k + batch_size]
        batch = collate_left([inputs[i] for i in chunk], tokenizer.pad_token_id)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        for i, row in zip(chunk, out[:, batch["input_ids"].shape[1] :]):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    return answers


def evaluate(path, n_per_task: int = 60, seed: int = 12345, tasks=TASKS, loaded=None) -> dict[str, float]:
    """Accuracy per task (exact match of the stripped greedy answer)."""
    model, tokenizer, image_processor = loaded or load(path)
    result = {}
    for task in tasks:
        examples = make_sized_examples(task, n_per_task, seed)
        answers = generate_answers(model, tokenizer, image_processor, examples)
        result[task] = sum(a == ex[2] for a, ex in zip(answers, examples)) / len(examples)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=["demo-qwen"], help="checkpoint directories (or demo-qwen)")
    ap.add_argument("--n", type=int, default=60, help="examples per task")
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    results = {}
    for p in args.paths:
        path = pathlib.Path(p)
        if not path.exists() and qwen_checkpoint_dir(p).exists():
            path = qwen_checkpoint_dir(p)
        t = time.perf_counter()
        results[p] = evaluate(path, n_per_task=args.n, seed=args.seed)
        print(f"{p}: evaluated in {time.perf_counter() - t:.1f}s")
    print(format_table(results))


if __name__ == "__main__":
    main()
