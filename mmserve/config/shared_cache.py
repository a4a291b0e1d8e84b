"""The `[shared_cache]` section (the Redis tier under both caches): its keys, and where its secret
comes from (inline, a file, or an environment variable) and how it is checked."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.config.checks import (
    MIN_SHARED_SECRET_BYTES, SHARED_CACHE_TRUST, check_choice, check_int, check_number, check_str, fail)


@dataclass(frozen=True)
class SharedCacheConfig:
    """The shared cache tier (Redis) under both caches of every model; off while `url` is ""."""

    url: str = field(default="", repr=False)  # redis://[:password@]host:port/db, rediss:// (TLS); "": off
    lookup_deadline_ms: float = 50.0  # a look-up answered later than this is a miss
    ttl_s: int = 3600  # entries expire this long after they were written or last read
    write_queue: int = 256  # values waiting to be written; beyond this new ones are dropped (counted)
    write_batch: int = 32  # values written in one pipelined round trip
    backoff_s: float = 1.0  # after an error the tier is off this long, doubling up to max_backoff_s
    max_backoff_s: float = 30.0
    socket_timeout_s: float = 1.0  # the client's connect and socket timeout (bounds a write round trip)
    # a response ends once the KV blocks it committed are in Redis (so the next turn finds them on
    # any replica), waiting at most this long for them; 0: it ends at once (writes in the background)
    finish_flush_ms: float = 500.0
    # Every value carries an HMAC-SHA256 tag under a secret the replicas share (at least 16 bytes),
    # given here, in a file, or in an environment variable — at most one of the three. Without
    # one the tier refuses to start unless trust = "network" (see secret_bytes)
    secret: str = field(default="", repr=False)
    secret_file: str = ""  # a file holding the secret (surrounding whitespace ignored)
    secret_env: str = ""  # the name of an environment variable holding the secret
    trust: str = "secret"  # "secret": values must verify under the secret; "network": every writer of this Redis is trusted

    def __post_init__(self) -> None:
        w = "[shared_cache]"
        check_str(w, "url", self.url, empty=True)
        if not isinstance(self.secret, str):  # the value is never echoed: it may be the secret
            raise ValueError(f"config {w} secret: must be a string, got a {type(self.secret).__name__}")
        check_str(w, "secret_file", self.secret_file, empty=True)
        check_str(w, "secret_env", self.secret_env, empty=True)
        check_choice(w, "trust", self.trust, SHARED_CACHE_TRUST)
        given = [k for k in ("secret", "secret_file", "secret_env") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"config {w}: set at most one of secret, secret_file and secret_env, got {given}")
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            fail(w, "url", "a redis://, rediss:// or unix:// URL (or \"\" for off)", self.url.split("@")[-1])
        check_number(w, "lookup_deadline_ms", self.lookup_deadline_ms, 0, lo_open=True)
        check_int(w, "ttl_s", self.ttl_s, 1)
        check_int(w, "write_queue", self.write_queue, 1)
        check_int(w, "write_batch", self.write_batch, 1)
        check_number(w, "backoff_s", self.backoff_s, 0, lo_open=True)
        check_number(w, "max_backoff_s", self.max_backoff_s, self.backoff_s, bound=f">= backoff_s ({self.backoff_s})")
        check_number(w, "socket_timeout_s", self.socket_timeout_s, 0, lo_open=True)
        check_number(w, "finish_flush_ms", self.finish_flush_ms, 0)
        if self.enabled:
            if not given and self.trust != "network":
                raise ValueError(
                    f"config {w}: url is set but no secret: set secret (or secret_file, or secret_env) to a key "
                    f"of at least {MIN_SHARED_SECRET_BYTES} bytes that every replica shares, so a value written to "
                    f"Redis by anyone else is refused; or set trust = \"network\" if every client that can "
                    f"write to this Redis is trusted (docs/shared-cache.md)")
            self.secret_bytes()  # read now: a missing file or variable is a config error at start

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def secret_bytes(self) -> bytes | None:
        """The shared secret (from `secret`, `secret_file` or `secret_env`), or None when none is
        set (trust = "network"). ValueError when it cannot be read or is too short."""
        w = "[shared_cache]"
        if self.secret:
            raw, where = self.secret.encode(), "secret"
        elif self.secret_file:
            try:
                raw = Path(self.secret_file).expanduser().read_bytes().strip()
            except OSError as e:
                raise ValueError(f"config {w} secret_file: cannot read {self.secret_file!r}: {e.strerror}") from None
            where = f"secret_file {self.secret_file!r}"
        elif self.secret_env:
            value = os.environ.get(self.secret_env)
            if value is None:
                raise ValueError(f"config {w} secret_env: the environment variable {self.secret_env!r} is not set")
            raw, where = value.strip().encode(), f"secret_env {self.secret_env!r}"
        else:
            return None
        if len(raw) < MIN_SHARED_SECRET_BYTES:
            raise ValueError(f"config {w} {where}: the secret must be at least {MIN_SHARED_SECRET_BYTES} bytes "
                             f"(e.g. `openssl rand -hex 32`), got {len(raw)}")
        return raw
