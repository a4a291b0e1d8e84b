"""Who may write the KV arena now: the check made where KV is written (issue 42, item 1).

Every writer of the arena — a model step (its K/V, its block copies) and a shared-tier restore —
writes only inside the fence (`WriteFence.writing`, `writing_granted`), which registers it for as
long as it runs. The fence alone holds the cache manager's life (the epoch; the arena knows none):
a step is told the life as of its entry (its sequences' tables name the life they were granted
in); a restore tells the fence the life its blocks were granted in, and the fence refuses it when
a later one has begun. The manager starts a life with `new_epoch`, in the same event-loop turn as
its fresh bookkeeping and before it grants or restores anything; under the fence's lock that call
both moves the epoch and collects every writer registered at that moment, with the blocks it may
write. So each writer is on exactly one side:

- entered before the new life: it is in the list, and the manager holds its blocks (quarantine,
  `StepFence(writer)`) until the writer leaves and its `on_return` reports it (`StepReturned`);
- entered after: it sees the new epoch, and writes nothing for tables granted in an earlier life
  (the step drops those sequences, a restore writes nothing).

No timing enters into it: a writer slowed anywhere — between its epoch check and its write, or
between two layers — is fenced by the data structure, not by a message that might come late.

On a GPU, `writing` covers what the host enqueues; the device work follows in stream order, and
every later write (a step, a restore) is enqueued on the same stream after it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

STEP_IDS = itertools.count()
"""One number space for the generator's steps and the fence's writers (`StepFence`, `StepReturned`
name either): a number is never reused in a process."""


class _Writer:
    __slots__ = ("blocks", "on_return")

    def __init__(self, blocks: Callable[[], Iterable[int]]):
        self.blocks = blocks
        self.on_return: Callable[[int], None] | None = None


class WriteFence:
    """The writers in flight of one KV arena and the manager's life they may write for, `epoch`
    (None: no manager tracks the arena — a bare runner, a test): only `new_epoch` moves it (see the
    module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._writers: dict[int, _Writer] = {}

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @contextmanager
    def writing(self, blocks: Callable[[], Iterable[int]]) -> Iterator[int | None]:
        """Registers a writer for the body's duration and gives the epoch as of its entry: the body
        writes only blocks of tables granted in that life. `blocks()` — called at most once, on the
        manager's thread, only if a new life starts meanwhile — names every block the body may
        write."""
        writer = _Writer(blocks)
        wid = next(STEP_IDS)
        with self._lock:
            self._writers[wid] = writer
            epoch = self._epoch
        try:
            yield epoch
        finally:
            with self._lock:
                del self._writers[wid]
                on_return = writer.on_return
            if on_return is not None:
                on_return(wid)

    @contextmanager
    def writing_granted(self, epoch: int, blocks: Callable[[], Iterable[int]]) -> Iterator[bool]:
        """A writer of `blocks()`, granted in the manager's life `epoch` (a shared-tier restore):
        registered as `writing` registers one; True when `epoch` is the life as of its entry (it
        writes), False when a later life has begun (it writes nothing: those blocks may be
        another's now)."""
        with self.writing(blocks) as now:
            yield now == epoch

    def new_epoch(self, epoch: int, on_return: Callable[[int], None]) -> list[tuple[int, tuple[int, ...]]]:
        """The manager's new life: from now on a writer that enters writes for `epoch` only.
        Returns the writers still in flight, `(writer, blocks it may write)`, each of which calls
        `on_return(writer)` when it leaves: the caller holds those blocks until then."""
        with self._lock:
            self._epoch = epoch
            fenced = []
            for wid, writer in self._writers.items():
                writer.on_return = on_return
                fenced.append((wid, tuple(dict.fromkeys(writer.blocks()))))
        return fenced

    def writers(self) -> int:
        """Writers in flight (for tests and `/debug/cache`)."""
        with self._lock:
            return len(self._writers)
