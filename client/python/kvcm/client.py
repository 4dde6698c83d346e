"""kvcm.Client: the synchronous client of the kvcm-manager (the C++ kvcm::Client's twin).

Every call runs under a deadline (default_deadline_ms unless the call passes deadline_ms)
that covers all its retries; only UNAVAILABLE is retried, with exponential backoff and
jitter, at most max_attempts times (non_idempotent_max_attempts for Reserve, Unreserve and
Evict). The defaults ride out a manager takeover (kvcm.ClientOptions). A failure raises the
kvcm.KvcmError subclass of its gRPC code. A retried call whose first reply was lost may run
twice on the manager: Insert is idempotent, a duplicated pin lapses with its lease, a
retried Release may answer NotFound.

After register_model, prompts of that namespace are hashed locally and travel as page
hashes; otherwise as tokens, which the manager hashes. When the manager refuses the hashes
as stale (its secret changed, or it restarted and forgot the namespace), the client
re-registers with the spec it registered and sends once more, within the same deadline.

Thread-safe: one Client may be shared by any number of threads.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, TypeVar

import grpc

from kvcm import _convert
from kvcm._commands import Command, Commands, Rpc, bind_commands
from kvcm._core import PageHashesLike
from kvcm._options import Backoff, final_error
from kvcm.errors import FailedPrecondition, KvcmError, error_for
from kvcm.types import CacheEvent, MatchResult, Namespace, NamespaceLike, as_namespace

T = TypeVar("T")

# Deadline of the best-effort release when a PinnedPrefix's `with` block ends.
RELEASE_DEADLINE_MS = 1000


class PinnedPrefix:
    """A pin on a matched prefix; `with` releases it (best effort) when the block ends.

    Without `with`, call release(); a pin nobody releases lapses with its lease. Not
    thread-safe: one owner at a time.
    """

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
        """The match the pin was taken on (lease expiry updated by renew())."""
        return self._match

    @property
    def pin_id(self) -> int:
        """0 when no pin is held (nothing matched, or released)."""
        return self._pin_id

    def release(self, *, deadline_ms: Optional[int] = None) -> None:
        """Drops the pin now. Afterwards nothing is held, whatever the outcome."""
        if self._pin_id == 0:
            return
        pin_id, self._pin_id = self._pin_id, 0
        self._client.release(self._ns, pin_id, deadline_ms=deadline_ms)

    def renew(self, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None) -> int:
        """Extends the lease to now + ttl_ms (0: the manager's default); returns the new
        expiry (unix ms). FailedPrecondition when no pin is held; Aborted when it expired."""
        if self._pin_id == 0:
            raise FailedPrecondition("PinnedPrefix holds no pin")
        expiry = self._client.renew_lease(self._ns, self._pin_id, ttl_ms, deadline_ms=deadline_ms)
        self._match = replace(self._match, lease_expiry_unix_ms=expiry)
        return expiry

    def __enter__(self) -> "PinnedPrefix":
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = min(self._client.options.default_deadline_ms, RELEASE_DEADLINE_MS)
        try:
            self.release(deadline_ms=deadline)
        except KvcmError:
            pass  # best effort: a pin the manager did not hear about lapses with its lease

    def __repr__(self) -> str:
        return (
            f"PinnedPrefix(ns={self._ns}, pin_id={self._pin_id}, "
            f"matched_pages={self._match.matched_pages})"
        )


class EventStream:
    """A WatchEvents subscription: iterate it for CacheEvents. No deadline, no retries;
    after the stream ends (an exception other than after cancel()), subscribe again.

    Iteration raises ResourceExhausted when the manager dropped a slow subscriber and
    Unavailable when the connection was lost; after cancel() it just stops.
    cancel() may be called from any thread.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[CacheEvent]:
        try:
            for event in self._call:
                yield _convert.event_from_proto(event)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise final_error(e, 1) from None

    def cancel(self) -> None:
        """Ends the stream; iteration stops."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _sync_method(cmd: Callable[..., Command[T]]) -> Callable[..., T]:
    def method(self: "Client", *args: Any, **kwargs: Any) -> T:
        return self._run(cmd(self, *args, **kwargs))

    return method


@bind_commands(_sync_method)
class Client(Commands):
    """Synchronous client of the kvcm-manager's CacheManager service.

        client = kvcm.Client("kvcm:50051", tls_ca_file="ca.pem", token_file="worker.token")

    Give insecure=True (plaintext) or tls_ca_file (TLS; with tls_cert_file and tls_key_file
    for mutual TLS; ca_file, cert_file and key_file are their deprecated names). The address
    defaults to $KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051; one without a port is refused. The bearer token comes from token, else token_file, else $KVCM_TOKEN.
    Bad options raise InvalidArgument naming the field. Connects lazily: the first call
    connects and is retried while the manager is unavailable. Its calls are the commands of
    kvcm._commands.Commands (help(kvcm.Client) lists them).
    """

    def _open_channel(self, credentials: Any, options: Any) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(self.options.address, options=options)
        return grpc.secure_channel(self.options.address, credentials, options=options)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _invoke(self, rpc: Rpc) -> Any:
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
                return method(
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
                time.sleep(sleep)
                self._count(retries=1)

    def _run(self, cmd: Command[T]) -> T:
        """Runs a command: each Rpc it yields is invoked and its answer (or error) sent in."""
        try:
            rpc = next(cmd)
            while True:
                try:
                    response = self._invoke(rpc)
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
    ) -> PinnedPrefix:
        """match(pin=True) wrapped in a PinnedPrefix that `with` releases:

        with client.match_and_pin(ns, tokens) as prefix:
            prefix.match.pages ...
        """
        namespace = as_namespace(ns)
        match = self.match(
            namespace,
            tokens,
            page_hashes=page_hashes,
            requester_agent_id=requester_agent_id,
            pin=True,
            lease_ttl_ms=lease_ttl_ms,
            deadline_ms=deadline_ms,
        )
        return PinnedPrefix(self, namespace, match)

    def watch_events(self, ns: Optional[NamespaceLike] = None) -> EventStream:
        """Subscribes to index changes of `ns` (every namespace when None)."""
        call = self._stub.WatchEvents(self._watch_request(ns), metadata=self._metadata)
        return EventStream(call)


__all__ = ["Client", "EventStream", "PinnedPrefix", "RELEASE_DEADLINE_MS", "error_for"]
