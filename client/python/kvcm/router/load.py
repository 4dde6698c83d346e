"""What the router knows of each engine's load: its own requests in flight, the prefill
tokens it sent and that are not yet computed, and whether the engine answers.

Counts are the router's own (a router does not see other routers' requests). A request
holds a `Ticket` from begin() to end(); its prefill tokens count as queued until
prefill_done() (its first token, or its whole answer when not streamed) or end().
Not thread-safe: use it from one event loop (or one simulation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence


@dataclass
class Ticket:
    """One request on one engine."""

    engine_id: str
    prompt_tokens: int
    # Prompt tokens the engine is expected to compute: prompt_tokens - expected cached.
    prefill_tokens: int
    prefilling: bool = True
    open: bool = True


@dataclass
class EngineLoad:
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    # Monotonic time before which the engine counts as down (0: up).
    down_until: float = 0.0
    # Consecutive failures; the down period doubles with each, up to the tracker's max.
    failures: int = 0


class LoadTracker:
    """Per-engine load and health, for a fixed list of engine ids.

    `down_s` is how long an engine that failed is avoided (doubling per consecutive failure
    up to `max_down_s`); after it the engine is tried again, and one success clears it."""

    def __init__(self, engine_ids: Iterable[str], *, down_s: float = 2.0,
                 max_down_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engines: Dict[str, EngineLoad] = {e: EngineLoad() for e in engine_ids}
        if not self._engines:
            raise ValueError("engines: at least one engine is required")
        self.down_s = down_s
        self.max_down_s = max_down_s
        self._clock = clock

    @property
    def engine_ids(self) -> List[str]:
        return list(self._engines)

    def load(self, engine_id: str) -> EngineLoad:
        return self._engines[engine_id]

    def in_flight(self, engine_id: str) -> int:
        return self._engines[engine_id].in_flight

    def queued_prefill_tokens(self, engine_id: str) -> int:
        return self._engines[engine_id].queued_prefill_tokens

    # -- requests -------------------------------------------------------------------------

    def begin(self, engine_id: str, prompt_tokens: int, expected_cached_tokens: int) -> Ticket:
        load = self._engines[engine_id]
        prefill = max(0, prompt_tokens - expected_cached_tokens)
        load.in_flight += 1
        load.queued_prefill_tokens += prefill
        return Ticket(engine_id, prompt_tokens, prefill)

    def prefill_done(self, ticket: Ticket) -> None:
        """The engine has computed the ticket's prompt (idempotent)."""
        if ticket.prefilling:
            ticket.prefilling = False
            self._engines[ticket.engine_id].queued_prefill_tokens -= ticket.prefill_tokens

    def end(self, ticket: Ticket) -> None:
        """The request is over, answered or failed (idempotent)."""
        self.prefill_done(ticket)
        if ticket.open:
            ticket.open = False
            self._engines[ticket.engine_id].in_flight -= 1

    # -- health ---------------------------------------------------------------------------

    def mark_down(self, engine_id: str) -> float:
        """The engine failed a request; returns the seconds it is now avoided."""
        load = self._engines[engine_id]
        period = min(self.down_s * (2 ** load.failures), self.max_down_s)
        load.failures += 1
        load.down_until = self._clock() + period
        return period

    def mark_up(self, engine_id: str) -> None:
        load = self._engines[engine_id]
        load.failures = 0
        load.down_until = 0.0

    def is_up(self, engine_id: str) -> bool:
        return self._engines[engine_id].down_until <= self._clock()

    def available(self, among: Optional[Sequence[str]] = None) -> List[str]:
        """Engines of `among` (default: all) not marked down, in configuration order; every
        one of them when all are (a request is better tried on a failed engine than
        refused)."""
        now = self._clock()
        engines = list(self._engines) if among is None else list(among)
        up = [e for e in engines if self._engines[e].down_until <= now]
        return up or engines


__all__ = ["EngineLoad", "LoadTracker", "Ticket"]
