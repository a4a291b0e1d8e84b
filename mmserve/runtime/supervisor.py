"""Supervisor: runs the actors in one nursery, restarts the ones that die, answers health.

Health is computed from actor liveness held here — never by sending work through the actors — so
it answers in microseconds even while every actor is busy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.errors import ServiceUnavailable
from mmserve.logs import get_logger
from mmserve.config import SupervisorConfig


@dataclass
class ActorState:
    actor: Actor
    key: str
    alive: bool = False
    restarts: int = 0
    last_error: str | None = None
    died_at: float | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    run_scope: trio.CancelScope | None = None
    stalled: bool = False
    busy_since: float | None = None  # when the watchdog first saw it with work pending (None: idle)


def _describe(exc: BaseException) -> str:
    """`Type: message` of the root cause (nurseries wrap a task's exception in groups)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Health:
    """The runtime's health, or one model's (`model`). `models` maps each model to its state:
    "ok", "down" (an actor of it died or hung: restarting), "loading", "not_loaded" or "failed".

    `ok`: nothing is wrong, requests are admitted (a model not loaded yet is loaded by its first
    request); `Runtime.health(model)` narrows it to `serving`, as GET /health?model= does. `serving`: what a load balancer routes by — for one model, also that it is loaded:
    a request sent to a replica that has not loaded the model would wait for the whole load."""

    ok: bool
    actors: dict[str, bool] = field(default_factory=dict)
    reason: str | None = None
    models: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    retry_after_s: float = 1.0
    details: dict = field(default_factory=dict)  # informational, per actor (e.g. the shared cache tier's state)

    @property
    def state(self) -> str | None:
        """The model's state, for one model's health; None for the runtime's."""
        return None if self.model is None else self.models.get(self.model)

    @property
    def serving(self) -> bool:
        """`ok`, and for one model, loaded ("ok"): its requests are answered here without a load."""
        return self.ok and self.state in (None, "ok")

    @property
    def retry_after(self) -> float | None:
        """When asking again may find it serving; None while serving, and for a model that is not
        loaded (nothing but a request for it will load it)."""
        if self.serving or self.state == "not_loaded":
            return None
        return self.retry_after_s

    def to_json(self) -> dict:
        body = {"status": "ok" if self.serving else "unavailable", "actors": self.actors, "models": self.models}
        if self.details:
            body["details"] = self.details
        if self.model is not None:
            body["model"] = self.model
            body["state"] = self.state
        reason = self.reason or (None if self.serving else not_serving_yet(self.model, self.state))
        if reason:
            body["reason"] = reason
        return body


def not_serving_yet(model: str, state: str | None) -> str:
    if state == "loading":
        return f"model {model!r} is loading"
    return (f"model {model!r} is not loaded on this server: its first request here loads it "
            f"(load = \"eager\" loads it at start)")


def stall_error(limit: float) -> str:
    """An actor's last error after a stall (health's reason names the key to change)."""
    return (f"stalled: no progress for {limit:g}s with work pending (no model layer started in that time; "
            "if the model is only slow on this machine, raise [supervisor] stall_timeout_s)")


def model_of(key: str) -> str | None:
    """The model an actor key belongs to (`generator[demo]` → `demo`); None for shared actors."""
    return key[key.index("[") + 1:-1] if key.endswith("]") and "[" in key else None


class Supervisor:
    def __init__(self, config: SupervisorConfig):
        self.config = config
        self.states: dict[str, ActorState] = {}
        self.log = get_logger("supervisor")
        self._nursery: trio.Nursery | None = None
        self.ready = False
        self.draining = False

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self._watch)

    async def _watch(self) -> None:
        """Declares hung every actor that has had work pending for stall_timeout_s and made no
        progress in that time. The quiet time counts from when work arrived, never from before:
        an actor idle for a minute that is handed a job is not a minute late."""
        limit = self.config.stall_timeout_s
        while True:
            await trio.sleep(min(0.1, limit / 4))
            now = time.monotonic()
            for state in list(self.states.values()):
                actor = state.actor
                if not actor.has_work():
                    state.busy_since = None
                    continue
                if state.busy_since is None:
                    state.busy_since = now
                quiet = now - max(actor.last_progress, state.busy_since)
                if compute.busy_owner() == state.key:  # its step on the compute thread: slow is not hung
                    quiet = min(quiet, compute.quiet_for())
                if state.alive and state.run_scope is not None \
                        and quiet > limit and not self._waits_on_another(state.key, limit):
                    state.stalled = True
                    state.alive = False
                    state.died_at = now
                    state.last_error = stall_error(limit)
                    self.log.error("supervisor.actor_stalled", target=state.key, stalled_s=round(quiet, 3))
                    state.run_scope.cancel()
                    if compute.quiet_for() > limit and compute.busy_owner() == state.key:  # its hung step holds the thread
                        compute.replace(f"{state.key} stalled in a model step")

    @staticmethod
    def _waits_on_another(key: str, limit: float) -> bool:
        """Whether `key` is only queued behind another actor's hung step on the shared compute
        thread: that one is the hung actor, this one is waiting (and goes on once it is replaced)."""
        owner = compute.busy_owner()
        return compute.quiet_for() > limit and owner is not None and owner != key

    def start(self, actor: Actor) -> None:
        """Starts supervising `actor` under its key (e.g. `generator[demo]`, given when it was built)."""
        state = ActorState(actor, actor.key, alive=True)
        self.states[actor.key] = state
        self._nursery.start_soon(self._supervise, state)

    def stop(self, key: str) -> None:
        """Stops supervising and cancels the actor `key` (used when a model is unloaded)."""
        state = self.states.pop(key, None)
        if state is not None:
            state.scope.cancel()

    async def _supervise(self, state: ActorState) -> None:
        with state.scope:
            await self._run_with_restarts(state)

    async def _run_with_restarts(self, state: ActorState) -> None:
        backoff = self.config.restart_backoff_s
        while True:
            state.alive, state.stalled = True, False
            state.actor.progressed()
            started = trio.current_time()
            try:
                with trio.CancelScope() as state.run_scope:
                    await state.actor.run()
                if not state.stalled:
                    state.alive = False
                    return
                self._contain(state, stall_error(self.config.stall_timeout_s), stalled=True)
            except Exception as exc:  # an actor bug or a model failure: contain it, restart
                self._contain(state, _describe(exc), exc)
            if trio.current_time() - started >= self.config.healthy_reset_s:
                backoff = self.config.restart_backoff_s  # it ran healthy for a while: a fresh fault, not a loop
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self.config.max_restart_backoff_s)
            self.log.info("supervisor.actor_restarted", target=state.key, restarts=state.restarts)

    def _contain(self, state: ActorState, error: str, exc: BaseException | None = None,
                 stalled: bool = False) -> None:
        """Marks the actor down and fails every request it held, at once, with a clear 503. A
        stall's says what to change: the same request would stall the same way on a retry."""
        state.alive = False
        state.run_scope = None
        state.restarts += 1
        state.died_at = time.monotonic()
        state.last_error = error
        if stalled:
            message = (f"{state.key} stalled: no progress on this request for {self.config.stall_timeout_s:g} s "
                       "(no model layer started and nothing else moved in that time); it is being restarted. A model this slow on this "
                       "machine is not hung: raise [supervisor] stall_timeout_s, or send a smaller request "
                       "(fewer or smaller images, fewer tokens); a retry of the same request will stall again")
        else:
            message = f"{state.key} failed while handling this request ({error}); it is being restarted, retry shortly"
        failed = state.actor.fail_in_flight(ServiceUnavailable(message))
        self.log.error("supervisor.actor_died", target=state.key, error=error, failed_requests=failed,
                       restarts=state.restarts, exc_info=exc)

    def health(self, model: str | None = None, models: dict[str, str] | None = None) -> Health:
        """Health of the runtime (`model` None: every actor) or of one model (its actors and the
        shared intake). `models` gives the registry's state per model; a model whose actor is
        down is reported "down"."""
        actors = {k: s.alive for k, s in self.states.items()}
        states = dict(models or {})
        for key, alive in actors.items():
            owner = model_of(key)
            if not alive and owner in states:
                states[owner] = "down"
        if not self.ready:
            return Health(False, actors, "starting", states, model)
        if self.draining:
            return Health(False, actors, "draining: the server is shutting down", states, model, retry_after_s=5.0)
        relevant = [k for k in actors if model is None or model_of(k) in (None, model)]
        details = {k: self.states[k].actor.health_details() for k in relevant
                   if hasattr(self.states[k].actor, "health_details")}
        dead = [k for k in relevant if not actors[k]]
        if dead:
            reasons = "; ".join(f"{k}: {self.states[k].last_error or 'stopped'}" for k in dead)
            return Health(False, actors, f"actor(s) down: {reasons}", states, model,
                          retry_after_s=self._retry_after(dead), details=details)
        if model is not None and states.get(model) == "failed":
            return Health(False, actors, f"model {model!r} failed to load", states, model, retry_after_s=5.0,
                          details=details)
        return Health(True, actors, None, states, model, details=details)

    def _retry_after(self, dead: list[str]) -> float:
        """About when the restarts of `dead` will be done."""
        return min(self.config.max_restart_backoff_s, max(1.0, self.config.restart_backoff_s * 2))
