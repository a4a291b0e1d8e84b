"""The one OS thread that runs the process's model computations.

Why one thread: torch's CPU build parallelises ops with GNU OpenMP, and every OS thread that runs
a parallel op gets its own OpenMP team. Once the process holds more OpenMP threads than there are
CPUs, libgomp stops spin-waiting between parallel regions and puts its workers to sleep after
each op — every small op then pays a futex wake-up. With model steps spread over trio's worker
threads (encoder, generator, prefix-cache copies, model loading) a 2-core machine ran a 28-token
prefill in 46 ms instead of 28 ms. With every step on this one thread there is one team, and the
steps (which compete for the same cores anyway) simply queue.

The event loop itself must not start parallel ops either: keep its torch work to small tensors
(sampling runs here too).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import torch
import trio

from mmserve.logs import get_logger

T = TypeVar("T")

log = get_logger("compute")



_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_threads = 0  # torch intra-op threads for the compute thread; 0 = torch's default
_busy_since: float | None = None  # when the step now running started (None: idle)
_busy_owner: str | None = None  # who submitted it (an actor's supervisor key)
_busy_step: object | None = None  # which step the two above are of (set and cleared by that step alone)
_last_beat: float = 0.0  # when the step now running last reported progress from inside (`heartbeat`)
_unfinished: set[Future] = set()  # submitted steps not done yet: queued, taken by the thread, or running


@contextlib.contextmanager
def single_threaded():
    """Torch ops of the calling thread (the event loop's) run on one thread inside: a parallel op
    there would start a second OpenMP team, and the compute thread's steps would stay slower for
    the life of the process (measured: 1.75x on 2 cores). For the tensor copies actors must make
    outside the compute thread (the shared tier's export and restore of KV blocks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


DEFAULT_THREADS = torch.get_num_threads()
"""torch's intra-op threads when mmserve was imported: its default (the physical cores, or
OMP_NUM_THREADS), or what the program set before. Read once: worker threads set torch's
process-wide count to 1 later (loaders, the encoder's pixel work, the shared tier's copies)."""


def configure(threads: int) -> None:
    """Sets the compute thread's torch intra-op threads (0: `DEFAULT_THREADS`)."""
    global _threads
    _threads = threads or DEFAULT_THREADS
    if _executor is not None:
        _executor.submit(_set_threads, _threads)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="mmserve-compute", initializer=_init)
        return _executor


def _init() -> None:
    _set_threads(_threads or DEFAULT_THREADS)


def _set_threads(threads: int) -> None:
    """This thread's torch intra-op threads, for good. torch gives a thread its count lazily, at its
    first parallel op, from a process-wide value that any thread's `set_num_threads` overwrites: a
    compute thread set to 2 ran every step on 1 once a loader had set 1 in between (measured: the
    default config's `torch_threads = 0` served on 1 thread of 2). Asked first, the lazy setup is
    spent here and the count set next stays."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def _timed(owner, fn, *args):
    global _busy_since, _busy_owner, _busy_step
    step = object()
    _busy_since, _busy_owner, _busy_step = time.monotonic(), owner, step
    try:
        return fn(*args)
    finally:
        # only the step the record is of clears it: a hung step of a replaced thread that ends late
        # must not mark the new thread idle while its step runs (the watchdog would then never see
        # that one hang, nor replace the thread again: every later step waited behind it)
        with _lock:
            if _busy_step is step:
                _busy_since = _busy_owner = _busy_step = None


def heartbeat() -> None:
    """Progress from inside a step: a model's layers call this as each one starts (`beat_per_layer`),
    so a forward that is slow (a vision tower taking minutes on a CPU) is told from one that is
    hung (no layer starting for the stall limit)."""
    global _last_beat
    _last_beat = time.monotonic()


def quiet_for() -> float:
    """Seconds since the step now running started or last reported progress (0 when idle)."""
    since = _busy_since
    return time.monotonic() - max(since, _last_beat) if since is not None else 0.0


def beat_per_layer(model: torch.nn.Module) -> int:
    """Makes each layer of `model` (every element of its `ModuleList`s: the decoder's and the
    vision tower's blocks) report progress as it starts; a few hooks per forward, next to nothing
    in time. Returns the number of layers hooked."""
    hooked = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for layer in module:
                layer.register_forward_pre_hook(_beat_hook)
                hooked += 1
    return hooked


def _beat_hook(module, args) -> None:
    heartbeat()


def idle() -> bool:
    """No step queued or running on the compute thread."""
    return all(f.done() for f in list(_unfinished))


def busy_owner() -> str | None:
    """The owner of the step now running on the compute thread (None when idle or unnamed)."""
    return _busy_owner


def stop() -> bool:
    """Stops the compute thread taking work: steps still queued are dropped. True when no step is
    running or about to run. Python joins the thread when the interpreter exits, and would wait for
    such a step — a hung one for as long as it hangs — so a False means: leave with `os._exit`.
    (A step the thread has taken from its queue but not started yet counts: it would run.)"""
    global _executor
    with _lock:
        executor, _executor = _executor, None  # a later step (an embedding program's) gets a fresh thread
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)
    return not any(not f.done() for f in list(_unfinished))


def replace(reason: str) -> None:
    """Abandons the compute thread (a step in it hung) and starts a fresh one for later work."""
    global _executor
    with _lock:
        old, _executor = _executor, None
    if old is not None:
        old.shutdown(wait=False, cancel_futures=True)
        log.warning("compute.thread_replaced", reason=reason)


async def run(fn: Callable[..., T], *args, abandon_on_cancel: bool = False, owner: str | None = None,
              if_abandoned: Callable[[], Callable[[], None]] | None = None,
              submitted: Callable[[], None] | None = None) -> T:
    """Runs `fn(*args)` on the compute thread (with the caller's log context) and returns its
    result. Cancelled callers wait for the step to finish unless `abandon_on_cancel`, in which
    case the step finishes unobserved (its result is dropped). `owner` names the caller for the
    stall watchdog. A step still queued when the thread is replaced runs on the new thread.

    `if_abandoned`, with `abandon_on_cancel`: called (on the event loop, in the cancelled caller)
    when the caller gives up on a step that is still queued or running — not when it has returned;
    the callable it returns is called once that step has really finished (on the compute thread,
    after `fn` returned or raised) or was dropped unrun. What the step may still write is guarded
    between the two (the generator quarantines its blocks).

    `submitted`: called once the step is in the thread's queue (before this first waits), so a
    caller can queue another step behind it in order (the generator's overlapped steps)."""
    while True:
        try:
            return await _run_once(fn, args, abandon_on_cancel, owner, if_abandoned, submitted)
        except _Dropped:
            continue  # it never ran: nothing to undo, so it runs on the fresh thread


class _Dropped(Exception):
    """A step queued on a compute thread that `replace` abandoned: it never ran."""


async def _run_once(fn, args, abandon_on_cancel: bool, owner: str | None, if_abandoned=None, submitted=None):
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future: Future = _pool().submit(contextvars.copy_context().run, _timed, owner, fn, *args)
    _unfinished.add(future)
    if submitted is not None:
        submitted()

    def wake(_: Future) -> None:
        _unfinished.discard(future)
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(wake)
    if abandon_on_cancel:
        try:
            await done.wait()
        except BaseException:
            if if_abandoned is not None and not future.done():  # it may still write: guarded until it ends
                settled = if_abandoned()
                future.add_done_callback(lambda _: settled())  # at once if it ended meanwhile
            raise
    else:
        with trio.CancelScope(shield=True):
            await done.wait()
        await trio.lowlevel.checkpoint_if_cancelled()
    try:
        return future.result()
    except CancelledError:
        raise _Dropped() from None
