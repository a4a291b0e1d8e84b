"""Child processes of the benchmark and of the tests (`redis-server`, `mmserve serve`, `transformers
serve`). The rule: no process outlives what started it. Each has one owner, which starts it once
(a second start is an error, never a silent second process) and stops and waits for it in `finally`
— after an exception, on cancellation, on KeyboardInterrupt, and on SIGTERM (`mmserve bench` turns
SIGTERM into a cancellation of its scenarios). Where the owner cannot run its `finally` (it was
SIGKILLed), Linux still stops the child: `die_with_parent`."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Callable

import trio

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that has the kernel send `sig` to the child when its
    parent dies (Linux's `prctl(PR_SET_PDEATHSIG)`), even by SIGKILL; None where that cannot hold:
    not on Linux, and not off the main thread — the kernel signals the child when the *thread* that
    forked it ends, not its process, so a child forked from a worker thread (trio retires idle ones
    after 10 s) would be killed while its owner still needs it. Start children from the main thread
    (trio's event loop runs there) and wait for their readiness elsewhere.

    The function runs in the child between fork and exec: it only calls the already resolved
    `prctl`, then checks that the parent did not die before it was set (it would be missed)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    parent, prctl = os.getpid(), _PRCTL

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def stop_now(proc: subprocess.Popen) -> None:
    """SIGKILL and wait (reap): for a child with nothing to save."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


async def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30, *,
               group: bool = False) -> None:
    """`sig` (to its process group if `group`), up to `timeout_s` to exit, then SIGKILL; always
    waited for. Shielded: it finishes even when the caller is being cancelled (call it from
    `finally`)."""
    with trio.CancelScope(shield=True):
        for s, wait in ((sig, timeout_s), (signal.SIGKILL, None)):
            if proc.poll() is not None:
                return
            try:
                if group:
                    os.killpg(proc.pid, s)
                else:
                    proc.send_signal(s)
            except ProcessLookupError:
                pass
            try:
                await trio.to_thread.run_sync(proc.wait, wait)
                return
            except subprocess.TimeoutExpired:
                continue
