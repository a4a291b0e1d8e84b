"""A stand-in for a model's forward that takes a fixed time and releases the GIL: what the GPU's
idle time would be, measured on any device (`engine_overhead`).

`StandInForward(adapter, duration_s)` swaps two modules of a loaded adapter's model, in place,
and puts them back on exit:
- the language model (`adapter.language_model`, the decoder stack a paged step runs) becomes
  `_Body`: it notes when the step's device work starts and hands the input embeddings through as
  the "hidden states" (no allocation, no compute);
- the output head (`adapter.model.lm_head`) becomes `_Head`: it makes float logits of the right
  shape ([rows, vocab] on the model's device, one ordinary token winning in every row, the token
  changing call by call so detokenisation does real work), then sleeps (`time.sleep`: the GIL is
  free meanwhile, as while a GPU runs) until `duration_s` after the body's start.

Everything else a step does runs for real, on the runtime's own path: the scheduler's plan, block
draws, the runner's input building (ids, positions, segments, the embedding lookup, the attention
metadata), sampling (penalties, the EOS ban of `min_tokens`, argmax) with its device→host copy,
detokenisation and streaming. The two swapped modules are exactly the step's device work (the
decoder layers and the vocabulary projection), so `calls` — one `Call` per forward, from the
stand-in's own clock — give the stand-in's busy time, and the gaps between calls the host's.

The busy interval of a call ends at its nominal end (start + duration) even when the sleeping
thread gets the GIL back later: a GPU's kernel ends on time whatever the host does; a late host
shows as the next call's late start. Nothing here knows about the runtime's threads: a runtime
that launches step n+1 while step n runs (overlap scheduling) shows as calls back to back.

Two models of the device (`asynchronous`):
- **blocking** (the default): the head sleeps out the duration on the calling thread, so the
  compute thread's own work around a forward (the gather of carried tokens and the embedding
  lookup before it, the sampling ops after it) falls between two busy intervals;
- **asynchronous**, as a GPU's stream: the head returns at once, the call's busy interval is
  queued behind the previous one's (start = the later of its launch and the last call's end), and
  the step's samples become readable on the host at that end, not before — the one thing a GPU
  makes the host wait for (the event after the samples' device→host copy): `DeviceSample.ready`
  is a `DeviceClockEvent` while the stand-in is installed. The compute thread then runs on while
  the "device" works, as it does with CUDA's asynchronous launches, and the host work it does
  around a forward is hidden as a GPU hides it — unless the next step's launch comes after the
  queued work's end.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from mmserve.engine import step_sampling

SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog while a small red square sits in the middle of "
               "a blue picture and everyone looks at it for a while")


@dataclass(frozen=True)
class Call:
    """One forward of the stand-in: its busy interval (perf_counter seconds), the new tokens it
    carried (on the runner's static decode path: the batch bucket's rows, padding included), the
    logits rows it produced, `counters()` as read when it started, and when its thread
    woke from the sleep (after `end`: the OS's and the GIL's lateness, on a busy machine
    milliseconds; a GPU's step would have ended at `end`)."""

    start: float
    end: float
    tokens: int
    rows: int
    counters: tuple = ()
    woke: float | None = None


class _Body(torch.nn.Module):
    """The language model's stand-in: notes the start, returns the embeddings as hidden states.
    The token embedding stays the real model's (the model reaches it through here)."""

    def __init__(self, owner: "StandInForward", original: torch.nn.Module):
        super().__init__()
        self._owner = [owner]  # a list: not registered as a submodule (no cycle in the module tree)
        self._original = [original]

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._original[0].get_input_embeddings()

    def forward(self, inputs_embeds: torch.Tensor, *args, **kwargs) -> BaseModelOutputWithPast:
        self._owner[0]._begin(int(inputs_embeds.shape[1]))
        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class _Head(torch.nn.Module):
    """The output head's stand-in: logits of the right shape, then the rest of the fixed duration."""

    def __init__(self, owner: "StandInForward", vocab: int):
        super().__init__()
        self._owner = [owner]
        self.out_features = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._owner[0]._finish(hidden)


class StandInForward:
    """See the module docstring. `counters`: read at every call's start (e.g. the generator's step
    counters), so a window of calls can be matched with what the runtime counted meanwhile."""

    def __init__(self, adapter, duration_s: float, counters: Callable[[], tuple] = tuple,
                 asynchronous: bool = False):
        if duration_s < 0:
            raise ValueError(f"the stand-in's duration must be >= 0 s, got {duration_s}")
        self.adapter = adapter
        self.duration_s = float(duration_s)
        self.counters = counters
        self.asynchronous = asynchronous
        self._queued_until = 0.0  # asynchronous: when the work queued on the "device" so far ends
        self.calls: list[Call] = []
        self._lock = threading.Lock()  # calls may come from more than one thread (an overlapped runtime)
        self._pending: dict[int, tuple[float, int, tuple]] = {}  # per thread: (start, tokens, counters)
        head = adapter.model.lm_head
        vocab = int(getattr(head, "out_features", 0) or head.weight.shape[0])
        self.vocab = vocab
        self.token_cycle = winning_tokens(adapter, vocab)
        self.body, self.head = _Body(self, adapter.language_model), _Head(self, vocab)
        self._saved: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    # -- installing ------------------------------------------------------------------------------

    def __enter__(self) -> "StandInForward":
        model = self.adapter.model
        self._swap(*_parent_of(model, self.adapter.language_model), self.body)
        self._swap(model, "lm_head", self.head)
        if self.asynchronous:  # a step's samples are readable once the device's work before them ended
            to_host = step_sampling._to_host

            def timed_to_host(*args, **kwargs):
                sample = to_host(*args, **kwargs)
                return dataclasses.replace(sample, ready=DeviceClockEvent(self._queued_until, sample.ready))
            self._swap(step_sampling, "_to_host", timed_to_host)
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            parent, name, original = self._saved.pop()
            setattr(parent, name, original)

    def _swap(self, parent: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
        self._saved.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)

    # -- a call ----------------------------------------------------------------------------------

    def _begin(self, tokens: int) -> None:
        start = time.perf_counter()
        self._pending[threading.get_ident()] = (start, tokens, tuple(self.counters()))

    def _finish(self, hidden: torch.Tensor) -> torch.Tensor:
        start, tokens, counters = self._pending.pop(threading.get_ident())
        shape = (*hidden.shape[:-1], self.vocab)  # [rows, vocab] from a step, [1, vocab] from `prefill`
        rows = int(hidden.shape[:-1].numel())
        logits = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
        with self._lock:
            n = len(self.calls)
        logits[..., self.token_cycle[n % len(self.token_cycle)]] = 1.0
        if self.asynchronous:  # queued behind the work before it, the host goes on at once
            with self._lock:
                start = max(start, self._queued_until)
                self._queued_until = start + self.duration_s
                self.calls.append(Call(start, self._queued_until, tokens, rows, counters))
            return logits
        deadline = start + self.duration_s
        made = time.perf_counter()
        if made < deadline:
            # on the compute thread (the model's forward): releases the GIL, as a running GPU leaves the host free
            time.sleep(deadline - made)
        woke = time.perf_counter()
        with self._lock:
            self.calls.append(Call(start, max(deadline, made), tokens, rows, counters, woke))
        return logits


class DeviceClockEvent:
    """The asynchronous stand-in's stand-in for a CUDA event: complete once the stand-in's clock
    passed `end` (and the real event, if any, completed): `query` without waiting, `synchronize`
    sleeping until then."""

    def __init__(self, end: float, real=None):
        self.end, self.real = end, real

    def query(self) -> bool:
        return time.perf_counter() >= self.end and (self.real is None or self.real.query())

    def synchronize(self) -> None:
        left = self.end - time.perf_counter()
        if left > 0:
            # a worker thread's wait (`DeviceSample.wait`), as a real event's synchronize blocks it
            time.sleep(left)
        if self.real is not None:
            self.real.synchronize()


def winning_tokens(adapter, vocab: int) -> list[int]:
    """Ordinary text tokens (no special, image or end-of-sequence token) of a plain sentence, for
    the stand-in's logits to pick in turn; the ids below `vocab` (a tiny model's)."""
    tokenizer = adapter.tokenizer
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= set(getattr(adapter, "eos_token_ids", ()) or ())
    image = getattr(adapter, "image_token_id", None)
    if image is not None:
        special.add(int(image))
    ids = [int(i) for i in tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]]
    ids = [i for i in ids if i not in special and 0 <= i < vocab]
    if not ids:
        ids = [i for i in range(vocab) if i not in special][:16]
    return ids


def _parent_of(root: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(parent, attribute name) of `module` inside `root` (families nest the decoder differently)."""
    for name, m in root.named_modules():
        if m is module and name:
            parent, _, attr = name.rpartition(".")
            return root.get_submodule(parent) if parent else root, attr
    raise ValueError("the adapter's language model is not a submodule of its model")


def window_calls(calls: Sequence[Call], opened: float, closed: float) -> list[Call]:
    """The calls that started at or after `opened` and ended by `closed`, less the last one: it may
    already be a step after the window closed (the event loop saw the close a moment late)."""
    inside = [c for c in calls if c.start >= opened and c.end <= closed]
    return inside[:-1]
