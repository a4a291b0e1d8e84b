"""mmserve against transformers over one more VLM family: the prompts, the first-step logits
comparison and the greedy `generate` parity through a whole Runtime that the family tests share
(tests/test_<family>.py bind them to their model, its processor's inputs and their image sizes).

Exact means: mmserve's last-token logits within `MARGIN_ABS` of the model's own forward on the
processor's inputs; greedy tokens byte for byte `generate`'s, each step's top-2 logit margin
within `MARGIN_ABS` of generate's, the first time and again on prefix- and encoder-cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import trio
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mmserve import Runtime
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.paged_forward import forward_paged
from mmserve.models.demo import render_image
from tests.helpers import image_part

MARGIN_ABS = 1e-4  # logits and top-2 margins: mmserve vs transformers
COLOURS = ("red", "blue", "green")


def token_bytes(tokenizer):
    """Token id -> its bytes under the byte-level BPE."""
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return lambda i: bytes(decoder[c] for c in tokenizer.convert_ids_to_tokens(int(i)))


def chunked_prefill(adapter, prompt, rows) -> torch.Tensor:
    """`prompt` (its images' encoder `rows`) through the paged arena in chunks of 7 tokens, with
    the adapter's RoPE positions -> the last token's logits [vocab]."""
    embeds = adapter.embed(prompt.input_ids, [(s.start, e) for s, e in zip(prompt.spans, rows)])
    n = len(prompt.input_ids)
    arena = KVArena.for_model(adapter, 1 << 22, 16)
    table = tuple(range(-(-n // 16)))
    for s in range(0, n, 7):  # chunked prefill over the paged arena
        e = min(n, s + 7)
        logits = forward_paged(adapter, embeds[:, s:e], [Segment(table, s, e - s)], arena,
                                       adapter.rope_positions(prompt, n, s, e))
    return logits[0]


@dataclass(frozen=True)
class FamilyParity:
    name: str  # the preset, as printed
    prompts: dict[int, list[tuple[int, int]]]  # a prompt's number of images -> their (width, height)
    new_tokens: int = 12
    question: str = "What color is the shape?"
    shapes: tuple[str, ...] = ("circle",) * 3  # the i-th image's shape
    seed: int = 40  # the i-th image's is seed + i

    # -- the prompts ------------------------------------------------------------------------------

    def images_of(self, n: int) -> list:
        return [render_image(COLOURS[i], self.shapes[i], seed=self.seed + i).resize(size)
                for i, size in enumerate(self.prompts.get(n, []))]

    def hf_chat(self, n_images: int) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": self.question}]}]

    def openai_chat(self, images) -> list[dict]:
        return [{"role": "user", "content": [image_part(img) for img in images] + [{"type": "text",
                                                                                      "text": self.question}]}]

    # -- against transformers ---------------------------------------------------------------------

    def assert_first_step_logits(self, adapter, hf: dict, prompt, logits: torch.Tensor, n_images: int) -> None:
        """`logits` (mmserve's last-token logits after prefilling `prompt`) within MARGIN_ABS of the
        model's own forward on the processor's inputs `hf`."""
        with torch.inference_mode():
            ref = adapter.model(**hf).logits[0, -1]
        diff = float((logits - ref).abs().max())
        print(f"{self.name}, {n_images} images, {len(prompt.input_ids)} prompt tokens: max |logit diff| = {diff:.3g}")
        assert diff < MARGIN_ABS

    def generate(self, adapter, hf: dict) -> tuple[list[int], list[float]]:
        """transformers' greedy `generate` on `hf`: the new token ids and each step's top-2 logit margin."""
        with torch.inference_mode():
            out = adapter.model.generate(**hf, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                         do_sample=False, output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0, hf["input_ids"].shape[1]:].tolist()
        margins = [float(t[0] - t[1]) for t in (torch.topk(step[0].float(), 2).values for step in out.logits)]
        return ids, margins

    async def assert_runtime_equals_generate(self, adapter, config, expected: dict, at_once: bool = False) -> None:
        """Each prompt of `expected` ({images: generate's (ids, margins)}) twice through a Runtime on
        `config` (the second pass on cache hits), one after another or, `at_once`, each pass's all
        together: token bytes equal to generate's (less the answer lead mmserve cuts), each step's
        top-2 margin within MARGIN_ABS of its own; the second pass hit the prefix cache."""
        as_bytes = token_bytes(adapter.tokenizer)
        lead = adapter.answer_lead.encode()
        cached = []
        async with Runtime.open(config) as rt:

            async def ask(n: int):
                return await rt.chat_completion(self.openai_chat(self.images_of(n)), temperature=0,
                                                max_tokens=self.new_tokens, min_tokens=self.new_tokens,
                                                logprobs=True, top_logprobs=2)

            for attempt in range(2):
                got: dict = {}
                if at_once:
                    async def one(n: int) -> None:
                        got[n] = await ask(n)

                    async with trio.open_nursery() as nursery:
                        for n in expected:
                            nursery.start_soon(one, n)
                for n, (ids, margins) in expected.items():
                    c = got[n] if at_once else await ask(n)
                    tokens = [bytes(t.bytes) for t in c.choices[0].logprobs]
                    want = [as_bytes(i) for i in ids]
                    if want and want[0].startswith(lead) and not tokens[0].startswith(lead):  # the answer lead, cut
                        want[0] = want[0][len(lead):]
                    assert tokens == want, (n, attempt)
                    ours = [t.top[0].logprob - t.top[1].logprob for t in c.choices[0].logprobs]
                    worst = max(abs(a - b) for a, b in zip(ours, margins))
                    print(f"{self.name}, {n} images, pass {attempt + 1}: {len(tokens)} tokens equal, smallest top-2 "
                          f"margin {min(margins):.3g}, max |margin diff| {worst:.3g}")
                    assert worst < MARGIN_ABS, (n, attempt)
                    if attempt:
                        cached.append(c.usage.cached_tokens)
        assert all(cached), cached  # the second pass ran on prefix-cache hits
