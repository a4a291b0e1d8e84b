"""The trained demo models answer correctly on fresh held-out images — measured through the
runtime's own path (data: URL decoding, intake, encoder, generator), both models at once."""

from collections import defaultdict

import trio

from mmserve import Runtime
from mmserve.models.demo.evaluate import TASKS, make_examples
from tests.helpers import data_url

N_PER_TASK = 48
THRESHOLDS = {"color": 0.98, "background": 0.98, "first": 0.98, "second": 0.98, "second_turn": 0.98, "shape": 0.85}


def openai_messages(hf_messages, specs):
    images = iter(specs)
    out = []
    for m in hf_messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": data_url(next(images).render())}}
                if p["type"] == "image" else p
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


async def test_held_out_accuracy_both_models(demo_config):
    correct = defaultdict(int)
    wrong = defaultdict(list)
    limiter = trio.CapacityLimiter(8)

    async def one(rt, model, task, messages, expected):
        async with limiter:
            c = await rt.chat_completion(messages, model=model, temperature=0, max_tokens=4)
        answer = c.text.strip()
        if answer == expected:
            correct[model, task] += 1
        else:
            wrong[model, task].append((expected, answer))

    async with Runtime.open(demo_config) as rt:
        async with trio.open_nursery() as nursery:
            for model in ("demo", "demo-wide"):
                for task in TASKS:
                    for msgs, specs, expected in make_examples(task, N_PER_TASK, seed=777):
                        nursery.start_soon(one, rt, model, task, openai_messages(msgs, specs), expected)

    report = {k: correct[k] / N_PER_TASK for k in sorted(set(correct) | set(wrong))}
    print("accuracy:", report)
    for (model, task), acc in report.items():
        assert acc >= THRESHOLDS[task], f"{model} {task}: {acc:.3f} < {THRESHOLDS[task]}; wrong: {wrong[model, task][:5]}"
