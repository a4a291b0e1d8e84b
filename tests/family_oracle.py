"""The cache-on ≡ cache-off oracle over one more VLM family beside the trained `demo` LLaVA: the
workloads and the judging rule the family oracles share (tests/test_oracle_<family>.py bind it
to their models and images).

The random-weight models' greedy margins are small, so their answers carry logprobs and a
mismatch is judged by PITFALLS.md's rule: the cached path's logits differ from a full prefill's by
~1e-7, so a flip is tolerated only where both sides' top-2 margin is below `TIE` and the two swapped
their top two tokens; everything before it must be equal, every tolerated flip is reported (a
warning naming it), and nothing else is loosened. The trained LLaVA's answers must be equal text.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio
from hypothesis import strategies as st

from mmserve import SyncRuntime
from mmserve.models.demo import BACKGROUNDS, COLORS, Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SHAPE, SHAPES, render_image
from tests.conftest import on_device
from tests.helpers import assert_nothing_held, image_part, run_concurrently

TIE = 1e-4  # top-2 logit margin below which a flip is a float tie (PITFALLS.md)
QUESTIONS = [Q_COLOR, Q_BACKGROUND, Q_SHAPE, Q_FIRST]


def oracle_images(sizes, seed: int) -> list:
    """The oracle's images: the i-th of each colour, shape and background in turn, drawn from
    seed + i, at sizes[i] (None: render_image's own)."""
    return [render_image(COLORS[i % 6], SHAPES[i % 3], BACKGROUNDS[i % 3], seed=seed + i, size=size)
            for i, size in enumerate(sizes)]


@dataclass(frozen=True)
class Turn:
    images: tuple[int, ...]  # indices into the oracle's images
    question: str
    disconnect_after: int | None  # abandon the request after this many deltas (None: read it all)


@dataclass(frozen=True)
class Conversation:
    model: str
    system: str | None
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Ask:
    model: str
    images: tuple[int, ...]
    n: int
    tokens: int


@dataclass
class FamilyOracle:
    images: list  # PIL images, referred to by index
    random: tuple[str, ...]  # random-weight models: judged token by token with the tie rule
    models: list[str]  # drawn from (repeat a name to draw it more often)
    flips: list[str] = field(default_factory=list)  # every tolerated flip, also warned about

    # -- the runtimes ---------------------------------------------------------------------------

    @contextmanager
    def runtimes(self, demo_config, models, **cached):
        """(on, off): the demo LLaVA and `models` (ModelConfigs) loaded at once, on the device, in
        a runtime with the caches on (`demo_config`'s settings replaced by `cached`: a tiny arena,
        a small encoder cache) and one with them off; on leaving, the tolerated flips printed."""
        config = on_device(demo_config.replace(models=(demo_config.models[0], *models)))
        with SyncRuntime(config.replace(kv_cache={"prefix_caching": False}, encoder_cache={"enabled": False})) as off:
            with SyncRuntime(config.replace(**cached)) as on:
                yield on, off
        if self.flips:
            print(f"\n{len(self.flips)} float-tie flips tolerated:\n" + "\n".join(self.flips))

    # -- requests and the judging rule ------------------------------------------------------------

    def ask(self, rt, model: str, messages: list, tokens: int, n: int = 1):
        """The completion of a greedy request (logprobs with the top two for the random models)."""
        extra = dict(logprobs=True, top_logprobs=2) if model in self.random else {}
        return rt.chat_completion(messages, model=model, temperature=0, max_tokens=tokens, min_tokens=tokens, n=n,
                                  **extra)

    def mismatch(self, model: str, got, expected, where) -> str | None:
        """None when choice `got` (caches on) is the same answer as `expected` (caches off) under
        the oracle's rule; else what differs."""
        if model not in self.random:
            return None if got.text == expected.text else f"{got.text!r} != {expected.text!r}"
        a, b = got.logprobs, expected.logprobs
        for k, (x, y) in enumerate(zip(a, b)):
            if x.bytes == y.bytes:
                continue
            margins = (x.top[0].logprob - x.top[1].logprob, y.top[0].logprob - y.top[1].logprob)
            swapped = (x.top[0].bytes, x.top[1].bytes) == (y.top[1].bytes, y.top[0].bytes) == (x.bytes, y.bytes)
            if swapped and max(margins) < TIE:
                note = f"{model} token {k}: {bytes(x.bytes)!r} / {bytes(y.bytes)!r}, margins {margins} ({where})"
                self.flips.append(note)
                warnings.warn(f"float tie tolerated: {note}")
                return None  # the answers part here; everything before was equal
            return f"token {k}: {bytes(x.bytes)!r} != {bytes(y.bytes)!r} (top-2 margins {margins})"
        if len(a) != len(b) or got.text != expected.text:
            return f"{got.text!r} != {expected.text!r}"
        return None

    def user_message(self, turn: Turn) -> dict:
        parts = [image_part(self.images[i]) for i in turn.images]
        return {"role": "user", "content": parts + [{"type": "text", "text": turn.question}]}

    def converse(self, on, off, c: Conversation, history: list, turn: Turn) -> str | None:
        """One turn with the caches off and on; appends it and the cache-off answer to `history`."""
        history.append(self.user_message(turn))
        expected = self.ask(off, c.model, history, 6).choices[0]
        problem = None
        if turn.disconnect_after is None:
            problem = self.mismatch(c.model, self.ask(on, c.model, history, 6).choices[0], expected, "turn")
        else:
            for i, _ in enumerate(on.chat(history, model=c.model, temperature=0, max_tokens=6, min_tokens=6)):
                if i >= turn.disconnect_after:
                    break
        history.append({"role": "assistant", "content": expected.text})
        return problem and f"{c.model}: {problem}"

    # -- workloads ------------------------------------------------------------------------------

    def conversations(self):
        image_ids = st.integers(0, len(self.images) - 1)

        @st.composite
        def conversation(draw):
            turns = []
            for t in range(draw(st.integers(1, 3))):
                images = draw(st.lists(image_ids, min_size=1, max_size=3)) if t == 0 else \
                    draw(st.lists(image_ids, max_size=1))
                turns.append(Turn(tuple(images), draw(st.sampled_from(QUESTIONS)),
                                  draw(st.one_of(st.none(), st.none(), st.integers(0, 1)))))
            return Conversation(draw(st.sampled_from(self.models)), draw(st.sampled_from([None, "Answer briefly."])),
                                tuple(turns))

        return conversation()

    def asks(self):
        return st.builds(Ask, st.sampled_from(self.models),
                         st.lists(st.integers(0, len(self.images) - 1), min_size=1, max_size=3).map(tuple),
                         st.integers(2, 3), st.integers(1, 24))

    # -- the checks -----------------------------------------------------------------------------

    def interleaved(self, runtimes, workload: list[Conversation]) -> None:
        """Conversations interleaved turn by turn: every cache-on turn is its cache-off answer."""
        on, off = runtimes
        histories = [[{"role": "system", "content": c.system}] if c.system else [] for c in workload]
        for t in range(max(len(c.turns) for c in workload)):
            for c, history in zip(workload, histories):
                if t < len(c.turns):
                    problem = self.converse(on, off, c, history, c.turns[t])
                    assert problem is None, (problem, history)

    def concurrently(self, runtimes, workload: list[Conversation]) -> None:
        """The conversations at once, each on its own thread; then nothing is held."""
        on, off = runtimes
        problems, errors = [], []

        def one(c: Conversation) -> None:
            history = [{"role": "system", "content": c.system}] if c.system else []
            try:
                for turn in c.turns:
                    problem = self.converse(on, off, c, history, turn)
                    if problem:
                        problems.append((problem, list(history)))
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        hung = run_concurrently(one, [(c,) for c in workload])
        assert not errors, errors
        assert not hung, "a conversation never ended"
        assert not problems, problems[:3]
        trio.from_thread.run(assert_nothing_held, on.runtime, trio_token=on._token)

    def greedy_choices(self, runtimes, workload: list[Ask]) -> None:
        """n > 1 at once: forks over one shared prefill, copied partial blocks, preemptions — each
        greedy choice is the single cache-off answer."""
        on, off = runtimes
        problems, errors = [], []

        def one(a: Ask) -> None:
            messages = [self.user_message(Turn(a.images, Q_COLOR, None))]
            try:
                expected = self.ask(off, a.model, messages, a.tokens).choices[0]
                for choice in self.ask(on, a.model, messages, a.tokens, n=a.n).choices:
                    problem = self.mismatch(a.model, choice, expected, f"choice {choice.index}")
                    if problem:
                        problems.append((a, problem))
            except BaseException as e:  # reported below, in the test's thread
                errors.append((a, e))

        hung = run_concurrently(one, [(a,) for a in workload])
        assert not errors, errors
        assert not hung, "a request never ended"
        assert not problems, problems[:3]
        trio.from_thread.run(assert_nothing_held, on.runtime, trio_token=on._token)

    def in_a_tiny_arena(self, runtimes, model: str) -> None:
        """12 three-image requests of `model` at once beside 4 LLaVA ones, in a tiny arena: the
        newest sequences are preempted and recomputed, cached blocks evicted, and every answer is
        its cache-off answer."""
        on, off = runtimes
        work = [(model if i % 4 else "demo",
                 [self.user_message(Turn(tuple((i + k) % len(self.images) for k in range(3)), Q_COLOR, None))])
                for i in range(16)]
        expected = [self.ask(off, m, messages, 8).choices[0] for m, messages in work]
        generator = loaded(on, model).generator
        before = generator.preemptions
        got: list = [None] * len(work)

        def one(i):
            got[i] = self.ask(on, work[i][0], work[i][1], 8).choices[0]

        # whether the arena overflows depends on how the threads' requests overlap: up to three
        # rounds, every one of them checked exactly, until one preempted
        for _ in range(3):
            assert not run_concurrently(one, [(i,) for i in range(len(work))]), "a request never ended"
            problems = [(i, p) for i, ((m, _), g, e) in enumerate(zip(work, got, expected))
                        if (p := self.mismatch(m, g, e, f"request {i}"))]
            assert not problems, problems
            if generator.preemptions > before:
                break
        assert generator.preemptions > before, "the arena was large enough: nothing was preempted"
        trio.from_thread.run(assert_nothing_held, on.runtime, trio_token=on._token)

    def reached_what_it_tests(self, runtimes, model: str) -> None:
        """Run last: `model` hit the prefix cache, evicted blocks and encoder entries, and
        preempted sequences (a test that reached none of it would prove nothing)."""
        on, _ = runtimes
        stats = on.stats()[model]
        generator = on.runtime.registry.require(model).generator
        print(f"{model}: {stats}, preemptions {generator.preemptions}, flips {len(self.flips)}")
        assert stats["prefix_cache"]["hit_blocks"] > 0 and stats["prefix_cache"]["evictions"] > 0
        assert stats["encoder"]["evictions"] > 0
        assert generator.preemptions > 0


def loaded(rt, model: str):
    """The model as `rt` serves it, loaded (a non-default model loads at its first request)."""
    rt.chat_completion([{"role": "user", "content": "hi"}], model=model, max_tokens=1)
    return rt.runtime.registry.require(model)
