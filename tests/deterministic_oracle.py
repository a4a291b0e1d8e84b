"""The strict oracle of `[runtime] deterministic = true` (issue 40): the workloads and the check that
tests/test_deterministic_oracle.py binds to every served family.

One runtime serves each request alone with both caches off (the reference); another serves the
same requests with the caches on, in a tiny arena (preemptions, evictions), prefill chunked at 24
tokens, all at once: multi-turn multi-image conversations, n > 1 choices, and prompts that hit a
prefix ending inside an image. Every generated token's logprob and its top-2 alternatives'
(float32 logits through log-softmax: equal logits, equal floats) must be `==` between the two —
0 tolerated flips, no margin rule. With the mode off the same check fails (the negative control).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

from mmserve import SyncRuntime
from mmserve.config import Config, ModelConfig
from mmserve.models.demo import Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SHAPE
from tests.conftest import on_device
from tests.family_oracle import oracle_images
from tests.helpers import image_part, run_concurrently

QUESTIONS = [Q_COLOR, Q_BACKGROUND, Q_SHAPE, Q_FIRST]


@dataclass(frozen=True)
class Family:
    model: str
    path: str
    sizes: tuple  # the oracle images' sizes (None: render_image's own)
    spare: int = 2  # the cached runtime's arena: blocks beyond the longest request's (few: it preempts)


@dataclass(frozen=True)
class Request:
    """A conversation's turns (each a list of image indices and a question), answered with
    `tokens` tokens a turn, `n` choices."""

    turns: tuple[tuple[tuple[int, ...], str], ...]
    tokens: int
    n: int = 1
    seed: int | None = None  # sampled at temperature 1 from this seed (None: greedy)


def workload(seed: int, images: int, conversations: int = 3, asks: int = 2) -> list[Request]:
    """A randomized workload: multi-turn conversations (2-3 images, then 0-1 a turn), greedy
    asks with n = 2, a seeded sampled ask, and a pair [X, Y] / [X, Z] whose second prompt hits the
    first's blocks up to inside X."""
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        turns = [(tuple(rng.sample(range(images), rng.randint(2, 3))), rng.choice(QUESTIONS))]
        for _ in range(rng.randint(1, 2)):
            turns.append((tuple(rng.sample(range(images), rng.randint(0, 1))), rng.choice(QUESTIONS)))
        out.append(Request(tuple(turns), rng.randint(3, 7)))
    for _ in range(asks):
        out.append(Request(((tuple(rng.sample(range(images), rng.randint(1, 2))), Q_COLOR),), rng.randint(2, 8), n=2))
    out.append(Request(((tuple(rng.sample(range(images), 2)), Q_SHAPE),), rng.randint(4, 8), seed=rng.randrange(1000)))
    x, y, z = rng.sample(range(images), 3)
    out += [Request((((x, y), Q_FIRST),), 4), Request((((x, z), Q_FIRST),), 6)]
    return out


def logprobs(choice) -> list:
    """Every token's id, logprob and top-2 (id, logprob): what must be equal, bit for bit."""
    return [(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top)) for t in choice.logprobs]


class Oracle:
    def __init__(self, family: Family, deterministic: bool = True, backend: str = "auto"):
        self.family = family
        self.backend = backend  # [runtime] attention_backend
        self.images = oracle_images(list(family.sizes), seed=700)
        self.deterministic = deterministic
        self.longest = 0  # the most tokens (prompt and answer) a reference request took
        self.cached: dict[int, int] = {}  # request index -> its last turn's cached prompt tokens (caches on)

    @contextmanager
    def runtimes(self, requests: list[Request]):
        """(on, off, want): caches off in a roomy arena, and each request's reference answered
        there alone (`want`); then caches on in an arena of `Family.spare` blocks beyond the
        longest request's, with 24-token steps (chunked prefills) and a 3-entry encoder cache."""
        model = ModelConfig(self.family.model, self.family.path, default=True)
        base = on_device(Config(models=(model,))).replace(runtime={"deterministic": self.deterministic,
                                                                    "attention_backend": self.backend})
        with SyncRuntime(base.replace(kv_cache={"prefix_caching": False}, encoder_cache={"enabled": False})) as off:
            want = [self.alone(off, r) for r in requests]
            block_bytes = self.loaded(off).generator.runner.kv.block_bytes
            blocks = -(-self.longest // 16) + self.family.spare
            on_config = base.replace(kv_cache={"block_size": 16, "budget_bytes": blocks * block_bytes},
                                     encoder_cache={"max_entries": 3}, generator={"max_batched_tokens": 24})
            with SyncRuntime(on_config) as on:
                yield on, off, want

    def loaded(self, rt):
        rt.chat_completion([{"role": "user", "content": "hi"}], max_tokens=1)
        return rt.runtime.registry.require(self.family.model)

    def message(self, images, question) -> dict:
        return {"role": "user", "content": [image_part(self.images[i]) for i in images]
                + [{"type": "text", "text": question}]}

    def ask(self, rt, history, tokens, n=1, seed=None):
        sampling = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        return rt.chat_completion(history, max_tokens=tokens, min_tokens=tokens, n=n, logprobs=True, top_logprobs=2,
                                  **sampling)

    def alone(self, off, request: Request) -> list[list]:
        """The reference: each turn alone, caches off; the turn's answer joins the history."""
        history, out = [], []
        for images, question in request.turns:
            history.append(self.message(images, question))
            answer = self.ask(off, history, request.tokens, seed=request.seed)
            self.longest = max(self.longest, answer.usage.total_tokens)
            out.append(logprobs(answer.choices[0]))
            history.append({"role": "assistant", "content": answer.choices[0].text})
        return out

    def served(self, on, request: Request, index: int = -1) -> list[list[list]]:
        """Each turn with the caches on (every choice's logprobs), the reference's text as history."""
        history, out = [], []
        for images, question in request.turns:
            history.append(self.message(images, question))
            answer = self.ask(on, history, request.tokens, request.n, request.seed)
            self.cached[index] = answer.usage.cached_tokens
            out.append([logprobs(c) for c in answer.choices])
            history.append({"role": "assistant", "content": answer.choices[0].text})
        return out

    def differences(self, on, want: list, requests: list[Request]) -> list:
        """The requests at once with the caches on, against each alone with them off (`want`):
        every (request, turn, choice) whose logprobs are not equal, bit for bit."""
        got: list = [None] * len(requests)
        errors: list = []

        def one(i):
            try:
                got[i] = self.served(on, requests[i], i)
            except BaseException as e:  # reported in the test's thread
                errors.append(e)

        # the two [X, *] prompts last and in order: the second hits the first's blocks
        assert not run_concurrently(one, [(i,) for i in range(len(requests) - 2)]), "a request never ended"
        one(len(requests) - 2)
        one(len(requests) - 1)
        assert not errors, errors
        return [(i, t, c) for i, (g, w) in enumerate(zip(got, want)) for t, (choices, ref) in enumerate(zip(g, w))
                for c, lp in enumerate(choices) if lp != ref]

    def hit_ends_inside_an_image(self, on, requests: list[Request]) -> bool:
        """Whether the last request's prefix hit ended inside one of its images (run after
        `differences`): the [X, Z] prompt after [X, Y]."""
        (images, question), = requests[-1].turns
        chat = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}]
        prompt = self.loaded(on).adapter.tokenize(chat, [self.images[i] for i in images])
        hit = self.cached[len(requests) - 1]
        return any(s.start < hit < s.start + s.length for s in prompt.spans)
