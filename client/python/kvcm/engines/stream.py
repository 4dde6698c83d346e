"""Sequencing one engine's KV-event stream: ordering, gaps, replay, resync, liveness.

vLLM (and SGLang, whose publisher is a copy of vLLM's) numbers its batches 0, 1, 2... on the
PUB socket and keeps the last `buffer_steps` in a replay buffer behind a ROUTER socket that
answers "every batch from seq s" and then an end marker. `EventStream` decides, from what
arrives, which batch to apply next and when to ask for a replay; it does no I/O (its
`StreamSink` does), so it is tested without sockets.

- A gap (seq > next) asks for a replay from the first missed seq; a replay whose first batch
  is past that seq cannot cover the gap, and neither can three replays in a row that bring
  nothing: the mirror is forgotten and rebuilt from everything the engine still buffers
  (a *full resync*, replay from 0).
- vLLM's ROUTER drops what its send queue cannot hold (1000 messages by default), so a long
  replay may skip batches: nothing after such a hole is applied, and the replay is asked for
  again from the hole (each round brings at least one more batch). A seq the buffer lacks
  between batches it holds (the publisher consumed it but failed to send it) is skipped and
  counted lost once a resync met it twice, rather than resyncing forever.
- A live seq at or below the previous live seq means the publisher restarted: full resync.
  So does a reconnect of its sockets (an idle engine that restarted sends nothing).
- A batch that does not decode triggers a full resync; within a full resync it is skipped.
- A full resync drops pending live batches (the replay brings back those the engine has); a
  gap replay that brings nothing means the pending batches are ahead of the engine (sent by
  an earlier run of it): they are dropped, not waited for.
- Liveness: with no batch for `probe_interval_s`, a replay request for the next seq probes
  the engine (vLLM answers at least the end marker, and any batch we missed). With nothing
  heard for `engine_timeout_s` the engine is down; it is up again once a full replay
  completes.
Without a replay endpoint a gap or restart resyncs from the next batch on, and the engine is
never declared down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class StreamSink(Protocol):
    def apply(self, seq: int, payload: bytes) -> bool:
        """Applies a batch to the mirror; False when it does not decode."""

    def request_replay(self, start_seq: int) -> None:
        """Sends a replay request (dropping any earlier one's answers)."""

    def reset(self) -> None:
        """Forgets the mirror: a full resync starts; publish nothing until synced()."""

    def synced(self) -> None:
        """The mirror holds everything the engine's stream still tells: publish it afresh."""

    def down(self) -> None:
        """The engine stopped answering: drop its pools."""


@dataclass
class StreamOptions:
    has_replay: bool = True
    # Idle time before a liveness probe, seconds.
    probe_interval_s: float = 2.0
    # A replay request whose answers stop for this long is abandoned, seconds.
    replay_timeout_s: float = 3.0
    # Nothing heard this long: the engine is down, seconds.
    engine_timeout_s: float = 10.0
    # Live batches kept while a replay runs; beyond, the oldest are dropped (replayed again).
    max_pending: int = 20_000
    # Replays in a row that bring nothing before a gap is declared unrecoverable.
    max_empty_replays: int = 3


@dataclass
class StreamCounters:
    batches: int = 0            # applied
    gaps: int = 0               # gaps seen on the live stream
    replays: int = 0            # replay requests sent (probes included)
    replay_holes: int = 0       # replays that skipped batches (asked again from the hole)
    probes: int = 0
    replay_timeouts: int = 0
    resyncs: int = 0            # full resyncs (not counting the first sync)
    restarts: int = 0           # publisher restarts detected
    bad_payloads: int = 0
    lost_batches: int = 0       # batches nothing could bring back
    stale_batches: int = 0      # live batches ahead of everything the engine holds, dropped


@dataclass
class _Replay:
    start: int
    full: bool          # from 0: whatever the engine's buffer starts with is accepted
    last_activity: float  # sent, or the last answer received
    got_any: bool = False
    applied: int = 0
    hole: bool = False  # a batch was skipped: ignore the rest, ask again from it


@dataclass
class EventStream:
    """Not thread-safe; `now` is a monotonic clock in seconds."""

    sink: StreamSink
    options: StreamOptions = field(default_factory=StreamOptions)
    counters: StreamCounters = field(default_factory=StreamCounters)

    def __post_init__(self) -> None:
        self.up = False
        self.next_seq: int | None = None
        self._last_live: int | None = None
        self._pending: dict[int, bytes] = {}
        self._replay: _Replay | None = None
        self._last_heard = 0.0
        self._last_request = float("-inf")
        self._empty_replays = 0
        # A full resync runs (mirror forgotten): synced() when a replay completes without a
        # hole; undecodable batches are skipped meanwhile.
        self._syncing = False
        # A seq a replay from it could not reach, once: see on_replay.
        self._unreachable: int | None = None

    # ---- inputs -----------------------------------------------------------------------

    def start(self, now: float) -> None:
        self._last_heard = now
        if self.options.has_replay:
            self._request(0, True, now)

    def on_live(self, seq: int, payload: bytes, now: float) -> None:
        self._last_heard = now
        restarted = self._last_live is not None and seq <= self._last_live
        self._last_live = seq
        if not self.options.has_replay:
            self._on_live_without_replay(seq, payload, restarted)
            return
        if restarted:
            self.counters.restarts += 1
            self._full_resync(now)
        if self._replay is not None or not self.up or self._syncing:
            self._pend(seq, payload)
            if self._replay is None:
                self._resume(now)
            return
        if self.next_seq is None:
            self.next_seq = seq
        if seq < self.next_seq:
            return  # already applied from a replay
        if seq == self.next_seq:
            self._apply(seq, payload, now)
            return
        self.counters.gaps += 1
        self._pend(seq, payload)
        self._request(self.next_seq, False, now)

    def on_replay(self, seq: int, payload: bytes, now: float) -> None:
        self._last_heard = now
        r = self._replay
        if r is None:
            return
        r.last_activity = now
        if r.hole:
            return
        r.got_any = True
        if self.next_seq is not None and seq < self.next_seq:
            return
        if self.next_seq is None or seq == self.next_seq:
            r.applied += 1
            self._apply(seq, payload, now)
            return
        if r.applied == 0 and not r.full:
            self.counters.lost_batches += seq - self.next_seq
            if self._unreachable == self.next_seq:
                # Twice the buffer skipped this seq with batches on both sides: a hole in
                # the engine's own history (a batch it failed to encode), never filled.
                self._unreachable = None
                r.applied += 1
                self._apply(seq, payload, now)
                return
            # The buffer no longer reaches back to next_seq (or has a hole there).
            self._unreachable = self.next_seq
            self._full_resync(now)
            return
        self.counters.replay_holes += 1
        r.hole = True

    def on_replay_end(self, now: float) -> None:
        self._last_heard = now
        r = self._replay
        if r is None:
            return
        self._replay = None
        if r.hole:
            self._resume(now)
            return
        self._empty_replays = 0 if r.got_any else self._empty_replays + 1
        if (not r.got_any and not r.full and self._pending
                and min(self._pending) > (self.next_seq or 0)):
            # The engine holds nothing from next_seq on, yet a later live batch is pending:
            # it came from an earlier run of the engine. Waiting for it would never end.
            self.counters.stale_batches += len(self._pending)
            self._pending.clear()
            self._last_live = None
            self._empty_replays = 0
        if self._syncing:
            self._syncing = False
            self.up = True
            self.sink.synced()
        self._drain(now)

    def on_bad_reply(self, now: float) -> None:
        """A replay answer that is not [seq, payload]: abandon the request."""
        self._replay = None

    def on_reconnect(self, now: float) -> None:
        """A socket to the engine connected again after a disconnect: it may have restarted."""
        if self.up or self.next_seq is not None:
            self.counters.restarts += 1
            if self.options.has_replay:
                self._full_resync(now)
            else:
                self._last_live = None

    def on_tick(self, now: float) -> None:
        o = self.options
        if not o.has_replay:
            return
        r = self._replay
        if r is not None and now - r.last_activity > o.replay_timeout_s:
            self.counters.replay_timeouts += 1
            self._replay = None
        if self.up and now - self._last_heard > o.engine_timeout_s:
            self.up = False
            self.next_seq = None
            self._last_live = None
            self._pending.clear()
            self._replay = None
            self.sink.reset()
            self.sink.down()
        if self._replay is not None or now - self._last_request < o.probe_interval_s:
            return
        if not self.up or self._syncing or self._pending:
            self._resume(now)
        elif now - self._last_heard >= o.probe_interval_s:
            self.counters.probes += 1
            self._resume(now)

    # ---- internals --------------------------------------------------------------------

    def _on_live_without_replay(self, seq: int, payload: bytes, restarted: bool) -> None:
        if not self.up:
            self.up = True
            self.sink.synced()
        elif restarted or (self.next_seq is not None and seq != self.next_seq):
            if restarted:
                self.counters.restarts += 1
            else:
                self.counters.gaps += 1
                self.counters.lost_batches += max(0, seq - (self.next_seq or 0))
            self.counters.resyncs += 1
            self.sink.reset()
            self.sink.synced()
        self.next_seq = seq
        self._apply(seq, payload, 0.0)

    def _pend(self, seq: int, payload: bytes) -> None:
        self._pending[seq] = payload
        if len(self._pending) > self.options.max_pending:
            del self._pending[min(self._pending)]

    def _resume(self, now: float) -> None:
        """Asks for what follows the last applied batch (everything, if none). An engine
        that is synced but has published nothing yet is asked from 0 without a resync, so
        probing it does not start a new session."""
        if self.next_seq is None:
            self._request(0, not (self.up and not self._syncing), now)
        else:
            self._request(self.next_seq, False, now)

    def _request(self, start: int, full: bool, now: float) -> None:
        self._replay = _Replay(start, full, now)
        self._syncing = self._syncing or full
        self._last_request = now
        self.counters.replays += 1
        self.sink.request_replay(start)

    def _apply(self, seq: int, payload: bytes, now: float) -> None:
        self.next_seq = seq + 1
        if self.sink.apply(seq, payload):
            self.counters.batches += 1
            return
        self.counters.bad_payloads += 1
        if self._syncing or not self.options.has_replay:
            self.counters.lost_batches += 1  # the engine's own history holds it: skip it
            return
        self._full_resync(now)

    def _full_resync(self, now: float) -> None:
        self.counters.resyncs += 1
        self.sink.reset()
        self.next_seq = None
        # The replay from 0 brings back whatever of these the engine still has; one ahead
        # of the engine (an earlier run's) would otherwise start the next resync.
        self._pending.clear()
        self._request(0, True, now)

    def _drain(self, now: float) -> None:
        """Applies pending live batches that now follow; asks again for a remaining gap."""
        while self._pending and self._replay is None:
            s = min(self._pending)
            payload = self._pending.pop(s)
            if self.next_seq is not None and s < self.next_seq:
                continue
            if self.next_seq is None or s == self.next_seq:
                self._apply(s, payload, now)
                continue
            self._pending[s] = payload
            if self._empty_replays >= self.options.max_empty_replays:
                self.counters.lost_batches += s - self.next_seq
                self._empty_replays = 0
                self._full_resync(now)
            else:
                self._request(self.next_seq, False, now)
            return
