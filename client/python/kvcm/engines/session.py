"""The manager side of one engine: PublishEngineEvents sessions, sequences and the outbox.

A session starts with a random non-zero id at sequence 1 and carries the mirror's snapshot
first (chunked), then its changes in order, one request in flight at a time; an empty
request is a heartbeat. A failed request is retried as is (the manager applies a repeated
sequence once), or answered by a new session, a re-registration, or a slow retry, as
`classify` says. `PublishSession` does no I/O, so it is tested without a manager.
"""

from __future__ import annotations

import enum
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field

from kvcm.engines.mirror import Change, ChangeKind

log = logging.getLogger(__name__)

# Bytes a change costs on the wire beyond its hashes (tags, lengths, enums), a bound.
_CHANGE_OVERHEAD = 16


class Action(enum.Enum):
    """What to do after a failed publish."""
    RETRY = "retry"              # transient: send the same request again after a backoff
    NEW_SESSION = "new_session"  # the manager lost or ended the session: resend everything
    REREGISTER = "reregister"    # the namespace or its key changed: register, rehash, resend
    AUTH = "auth"                # the token is refused: log loudly, retry slowly
    REFUSED = "refused"          # a request the manager calls invalid: new session, slowly


def classify(code: str, message: str) -> Action:
    """`code` is a grpc.StatusCode name ("FAILED_PRECONDITION")."""
    if code == "FAILED_PRECONDITION":
        if "sequence" in message:
            return Action.NEW_SESSION
        return Action.REREGISTER  # key fingerprint or hash version
    if code == "NOT_FOUND":
        return Action.REREGISTER  # the namespace is gone (deleted, or a fresh manager)
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return Action.AUTH
    if code in ("INVALID_ARGUMENT", "OUT_OF_RANGE", "UNIMPLEMENTED"):
        return Action.REFUSED
    return Action.RETRY


@dataclass
class SessionOptions:
    # Bytes of page hashes per request; the manager's max_message_bytes is 16 MiB.
    max_request_bytes: int = 2 << 20
    # Changes per request (the manager's limit).
    max_changes: int = 4096
    # Pages per chain (the manager's max_pages_per_request): a STORED chain is cut there (the
    # pages past it stay unpublished), a REMOVED of a page past it is dropped (never stored).
    max_chain_pages: int = 65_536
    # An empty request keeps the session alive after this long without one, seconds.
    heartbeat_interval_s: float = 10.0
    # Pages waiting beyond this (the manager unreachable for long): drop them and start a
    # new session from a snapshot once it answers.
    max_outbox_pages: int = 4 << 20


@dataclass(frozen=True)
class PublishRequest:
    session: int
    sequence: int
    changes: tuple[Change, ...]
    close: bool = False


class State(enum.Enum):
    IDLE = "idle"        # no session: the engine is not synced (or down, pools closed)
    OPEN = "open"        # publishing
    CLOSING = "closing"  # a close request is pending


@dataclass
class SessionCounters:
    requests: int = 0
    heartbeats: int = 0
    sessions: int = 0
    stored_pages: int = 0      # as the manager counted them
    removed_pages: int = 0
    truncated_chains: int = 0
    dropped_changes: int = 0   # outbox overflow, or REMOVED past max_chain_pages
    errors: dict[str, int] = field(default_factory=dict)  # by status code


class PublishSession:
    """Not thread-safe; `now` is a monotonic clock in seconds."""

    def __init__(self, options: SessionOptions | None = None):
        self.options = options or SessionOptions()
        self.counters = SessionCounters()
        self.state = State.IDLE
        self.session = 0
        self._seq = 0
        self._outbox: deque[Change] = deque()
        self._outbox_pages = 0
        self._inflight: PublishRequest | None = None
        self._last_sent = float("-inf")
        self._force_send = False
        self.overflowed = False  # the outbox was dropped: the owner must open() afresh

    @property
    def outbox_pages(self) -> int:
        return self._outbox_pages

    def open(self, snapshot: list[Change]) -> None:
        """Starts a new session whose first requests carry `snapshot`."""
        self.session = secrets.randbits(64) or 1
        self._seq = 0
        self._outbox.clear()
        self._outbox_pages = 0
        self._inflight = None
        self.overflowed = False
        self.state = State.OPEN
        self.counters.sessions += 1
        self.add(snapshot)
        self._force_send = True

    def suspend(self) -> None:
        """Stops publishing (a resync runs); the manager's TTL or the next open() ends it."""
        self.state = State.IDLE
        self._outbox.clear()
        self._outbox_pages = 0
        self._inflight = None

    def close(self) -> None:
        """Ends the session with close=true (the engine went away)."""
        had_session = self.state is not State.IDLE or self._seq > 0
        self.suspend()
        if had_session and self.session:
            self.state = State.CLOSING

    def add(self, changes: list[Change]) -> None:
        """Queues changes (dropped unless a session is open)."""
        if self.state is not State.OPEN:
            return
        cap = self.options.max_chain_pages * 16
        for c in changes:
            if len(c.page_hashes) > cap:
                if c.kind is ChangeKind.REMOVED:
                    self.counters.dropped_changes += 1
                    continue
                c = Change(c.kind, c.tier, c.page_hashes[:cap])
                self.counters.truncated_chains += 1
            self._outbox.append(c)
            self._outbox_pages += c.num_pages
        if self._outbox_pages > self.options.max_outbox_pages:
            self.counters.dropped_changes += len(self._outbox)
            log.warning("dropped %d unpublished pages (manager unreachable?); a new session "
                        "will resend the whole mirror", self._outbox_pages)
            self.suspend()
            self.overflowed = True

    def next_request(self, now: float) -> PublishRequest | None:
        """The request to send now, if any (the same one again until it succeeds)."""
        if self._inflight is not None:
            return self._inflight
        if self.state is State.CLOSING:
            self._inflight = PublishRequest(self.session, self._seq + 1, (), close=True)
            return self._inflight
        if self.state is not State.OPEN:
            return None
        if not self._outbox and not self._force_send and (
                now - self._last_sent < self.options.heartbeat_interval_s):
            return None
        budget, chunk = self.options.max_request_bytes, list[Change]()
        while self._outbox and len(chunk) < self.options.max_changes:
            size = len(self._outbox[0].page_hashes) + _CHANGE_OVERHEAD
            if chunk and size > budget:
                break
            budget -= size
            c = self._outbox.popleft()
            self._outbox_pages -= c.num_pages
            chunk.append(c)
        self._force_send = False
        if not chunk:
            self.counters.heartbeats += 1
        self._inflight = PublishRequest(self.session, self._seq + 1, tuple(chunk))
        return self._inflight

    def on_sent(self, now: float, stored_pages: int = 0, removed_pages: int = 0) -> None:
        """The in-flight request succeeded."""
        req = self._inflight
        if req is None:
            return
        self._inflight = None
        self._seq = req.sequence
        self._last_sent = now
        self.counters.requests += 1
        self.counters.stored_pages += stored_pages
        self.counters.removed_pages += removed_pages
        if req.close:
            self.state = State.IDLE
            self.session = 0
            self._seq = 0

    def on_failed(self, code: str, message: str) -> Action:
        """The in-flight request failed with a gRPC status; says what to do next. A close
        that fails is given up on any non-transient error (the session lapses by TTL)."""
        self.counters.errors[code] = self.counters.errors.get(code, 0) + 1
        action = classify(code, message)
        if self.state is State.CLOSING and action is not Action.RETRY:
            self._inflight = None
            self.state = State.IDLE
            self.session = 0
        return action
