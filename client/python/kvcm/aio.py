"""kvcm.aio.Client: the asyncio twin of kvcm.Client (grpc.aio), with the same methods,
semantics, retries and errors, as coroutines:

    async with kvcm.aio.Client("127.0.0.1:50051", insecure=True) as client:
        await client.register_model(ns, kvcm.ModelSpec.deepseek_v3())
        async with client.match_and_pin(ns, tokens) as prefix:
            ...

Use a client from the event loop it was created on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable, Generator, Optional, TypeVar

import grpc
import grpc.aio

from kvcm import _convert
from kvcm._commands import Command, Commands, Rpc, bind_commands
from kvcm._core import PageHashesLike
from kvcm._options import Backoff, final_error
from kvcm.client import RELEASE_DEADLINE_MS
from kvcm.errors import FailedPrecondition, KvcmError
from kvcm.types import CacheEvent, MatchResult, Namespace, NamespaceLike, as_namespace

T = TypeVar("T")


class PinnedPrefix:
    """A pin on a matched prefix; `async with` releases it (best effort) when the block
    ends. Without it, await release(); a pin nobody releases lapses with its lease."""

    def __init__(self, client: "Client", ns: Namespace, match: MatchResult) -> None:
        self._client = client
        self._ns = ns
        self._match = match
        self._pin_id = match.pin_id

    @property
    def namespace(self) -> Namespace:
        return self._ns

    @property
    def match(self) -> MatchResult:
        return self._match

    @property
    def pin_id(self) -> int:
        """0 when no pin is held (nothing matched, or released)."""
        return self._pin_id

    async def release(self, *, deadline_ms: Optional[int] = None) -> None:
        """Drops the pin now. Afterwards nothing is held, whatever the outcome."""
        if self._pin_id == 0:
            return
        pin_id, self._pin_id = self._pin_id, 0
        await self._client.release(self._ns, pin_id, deadline_ms=deadline_ms)

    async def renew(self, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None) -> int:
        """Extends the lease (0: the manager's default); returns the new expiry, unix ms."""
        if self._pin_id == 0:
            raise FailedPrecondition("PinnedPrefix holds no pin")
        expiry = await self._client.renew_lease(
            self._ns, self._pin_id, ttl_ms, deadline_ms=deadline_ms
        )
        self._match = replace(self._match, lease_expiry_unix_ms=expiry)
        return expiry

    async def __aenter__(self) -> "PinnedPrefix":
        return self

    async def __aexit__(self, *exc: object) -> None:
        deadline = min(self._client.options.default_deadline_ms, RELEASE_DEADLINE_MS)
        try:
            await self.release(deadline_ms=deadline)
        except KvcmError:
            pass  # best effort: the lease lapses on its own


class _PinContext:
    """What match_and_pin returns: await it for a PinnedPrefix, or `async with` it to
    match on entry and release on exit."""

    def __init__(self, make: Callable[[], Awaitable[PinnedPrefix]]) -> None:
        self._make = make
        self._prefix: Optional[PinnedPrefix] = None

    def __await__(self) -> Generator[Any, None, PinnedPrefix]:
        return self._make().__await__()

    async def __aenter__(self) -> PinnedPrefix:
        self._prefix = await self._make()
        return self._prefix

    async def __aexit__(self, *exc: object) -> None:
        if self._prefix is not None:
            await self._prefix.__aexit__(*exc)


class EventStream:
    """A WatchEvents subscription: `async for event in stream`. No deadline, no retries.
    Raises ResourceExhausted (dropped as too slow) or Unavailable (connection lost); after
    cancel() iteration just stops."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[CacheEvent]:
        try:
            async for event in self._call:
                yield _convert.event_from_proto(event)
        except asyncio.CancelledError:
            if self._cancelled:
                return
            raise
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise final_error(e, 1) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


def _async_method(cmd: Callable[..., Command[T]]) -> Callable[..., Awaitable[T]]:
    async def method(self: "Client", *args: Any, **kwargs: Any) -> T:
        return await self._run(cmd(self, *args, **kwargs))

    return method


@bind_commands(_async_method)
class Client(Commands):
    """Asynchronous client of the kvcm-manager; options as kvcm.Client, and the same calls
    (kvcm._commands.Commands) as coroutines."""

    def _open_channel(self, credentials: Any, options: Any) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(self.options.address, options=options)
        return grpc.aio.secure_channel(self.options.address, credentials, options=options)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _invoke(self, rpc: Rpc) -> Any:
        """Makes `rpc` until its deadline, retrying UNAVAILABLE."""
        self._count(calls=1)
        method = getattr(self._stub, rpc.method)
        backoff = Backoff(self.options)
        max_attempts = Backoff.attempts(self.options, rpc.idempotent)
        attempts = 0
        while True:
            attempts += 1
            self._count(attempts=1)
            try:
                return await method(
                    rpc.request,
                    timeout=max(rpc.deadline - time.monotonic(), 0.0),
                    metadata=self._metadata,
                )
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempts >= max_attempts:
                    raise self._final_error(e, attempts) from None
                sleep = backoff.next_sleep_s()
                if time.monotonic() + sleep >= rpc.deadline:
                    raise self._final_error(e, attempts) from None
                await asyncio.sleep(sleep)
                self._count(retries=1)

    async def _run(self, cmd: Command[T]) -> T:
        """Runs a command: each Rpc it yields is invoked and its answer (or error) sent in."""
        try:
            rpc = next(cmd)
            while True:
                try:
                    response = await self._invoke(rpc)
                except KvcmError as e:
                    rpc = cmd.throw(e)
                else:
                    rpc = cmd.send(response)
        except StopIteration as done:
            return done.value

    def match_and_pin(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        requester_agent_id: str = "",
        lease_ttl_ms: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> _PinContext:
        """`async with client.match_and_pin(ns, tokens) as prefix:` (released on exit), or
        `prefix = await client.match_and_pin(ns, tokens)`."""
        namespace = as_namespace(ns)

        async def make() -> PinnedPrefix:
            match = await self.match(
                namespace,
                tokens,
                page_hashes=page_hashes,
                requester_agent_id=requester_agent_id,
                pin=True,
                lease_ttl_ms=lease_ttl_ms,
                deadline_ms=deadline_ms,
            )
            return PinnedPrefix(self, namespace, match)

        return _PinContext(make)

    def watch_events(self, ns: Optional[NamespaceLike] = None) -> EventStream:
        call = self._stub.WatchEvents(self._watch_request(ns), metadata=self._metadata)
        return EventStream(call)


__all__ = ["Client", "EventStream", "PinnedPrefix"]
