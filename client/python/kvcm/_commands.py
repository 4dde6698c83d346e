"""The manager's calls, written once for kvcm.Client and kvcm.aio.Client. Internal.

Each command is a generator: it validates its arguments, builds requests and yields them as
`Rpc` steps, receives each answer (or has the call's KvcmError thrown in), and returns the
decoded result. The sync and async clients only run the steps (`bind_commands` installs
every command as a method that does). A new RPC is one command here.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Optional, Sequence, TypeVar, Union

from kvcm import _convert
from kvcm._core import (
    ClientCore,
    NamespaceKey,
    PageHashesLike,
    Prompt,
    is_stale_key,
    stale_refresh_error,
)
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm.errors import InvalidArgument, KvcmError
from kvcm.types import (
    DeleteNamespaceResult,
    EvictResult,
    ForgetAgentResult,
    InsertResult,
    MatchResult,
    ModelSpec,
    Namespace,
    NamespaceLike,
    PoolLike,
    RegisterModelResult,
    RouteCandidate,
    RoutePolicy,
    RouteResult,
    Stats,
    as_namespace,
)

T = TypeVar("T")


_SERVICE = pb.DESCRIPTOR.services_by_name["CacheManager"]


def retries_fully(method: str) -> bool:
    """Whether CacheManager.<method> is retried for the full schedule (max_attempts): its
    proto marks it safe to repeat (idempotency_level IDEMPOTENT or NO_SIDE_EFFECTS). Any
    other call makes at most non_idempotent_max_attempts attempts."""
    options = _SERVICE.methods_by_name[method].GetOptions()
    return options.idempotency_level != options.IDEMPOTENCY_UNKNOWN


@dataclass(frozen=True)
class Rpc:
    """One unary call for the client to make: CacheManager.<method>(request)."""

    method: str
    request: Any
    deadline: float  # time.monotonic() by which the call and its retries end

    @property
    def idempotent(self) -> bool:
        """Retried for the full schedule (max_attempts); otherwise
        non_idempotent_max_attempts. From the proto (retries_fully)."""
        return retries_fully(self.method)


# A command: yields Rpcs, is sent their responses, returns the call's result.
Command = Generator[Rpc, Any, T]


def command(fn: Callable[..., Command[Any]]) -> Callable[..., Command[Any]]:
    """Marks a Commands method for bind_commands."""
    fn._kvcm_command = True  # type: ignore[attr-defined]
    return fn


def bind_commands(wrap: Callable[[Callable[..., Command[Any]]], Callable[..., Any]]) -> Any:
    """Class decorator: installs wrap(cmd) for every @command of Commands, by its name."""

    def decorate(cls: Any) -> Any:
        for name, fn in vars(Commands).items():
            if getattr(fn, "_kvcm_command", False):
                method = functools.wraps(fn)(wrap(fn))
                # help() and inspect show what the call returns, not the generator.
                returns = str(method.__annotations__.get("return", ""))
                if returns.startswith("Command[") and returns.endswith("]"):
                    returns = returns[len("Command["):-1]
                    method.__annotations__ = {**method.__annotations__, "return": returns}
                    method.__signature__ = inspect.signature(fn).replace(  # type: ignore
                        return_annotation=returns)
                setattr(cls, name, method)
        return cls

    return decorate


class Commands(ClientCore):
    """ClientCore with the manager's calls as commands. Retries: every call is retried on
    UNAVAILABLE within its deadline; those the proto does not mark idempotent (Reserve,
    Unreserve, Evict) at most non_idempotent_max_attempts times (see ClientOptions)."""

    def _deadline(self, deadline_ms: Optional[int]) -> float:
        return time.monotonic() + self._deadline_s(deadline_ms)

    def _register(
        self, ns: Namespace, spec: ModelSpec, max_page_age_s: int, deadline: float
    ) -> Command[RegisterModelResult]:
        request = self._register_request(ns, spec, max_page_age_s)
        response = yield Rpc("RegisterModel", request, deadline)
        return self._registered(ns, spec, max_page_age_s, response)

    def _send_prompt(
        self, ns: Namespace, prompt: Prompt, build: Callable[[Optional[NamespaceKey]], Rpc]
    ) -> Command[Any]:
        """The Rpc build(key) makes with the namespace's cached key; when tokens were hashed
        with a stale key, re-registers once and sends again, within the same deadline."""
        key = self._prompt_key(ns, prompt)
        rpc = build(key)
        try:
            return (yield rpc)
        except KvcmError as e:
            # Hashes the caller computed cannot be redone with a fresh key: their refusal
            # is the answer (as the C++ MatchHashes / InsertHashes).
            if key is None or prompt.page_hashes is not None or not is_stale_key(e):
                raise
            try:
                yield from self._register(ns, key.spec, key.max_page_age_s, rpc.deadline)
            except KvcmError as refresh:
                raise stale_refresh_error(e, ns, refresh) from None
            return (yield build(self._prompt_key(ns, prompt)))

    @command
    def register_model(
        self,
        ns: NamespaceLike,
        spec: ModelSpec,
        *,
        max_page_age_s: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> Command[RegisterModelResult]:
        """Creates or confirms namespace `ns` and caches its hash key, so later calls on
        `ns` hash prompts locally. max_page_age_s (retention, seconds) only tightens."""
        ns = as_namespace(ns)
        return (yield from self._register(ns, spec, max_page_age_s, self._deadline(deadline_ms)))

    @command
    def match(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        requester_agent_id: str = "",
        pin: bool = False,
        lease_ttl_ms: int = 0,
        probe: bool = False,
        deadline_ms: Optional[int] = None,
    ) -> Command[MatchResult]:
        """Longest cached prefix of a prompt (tokens, or page_hashes from hash_prompt), and
        every replica of every matched page. pin takes a lease-bound pin; probe changes
        nothing (no recency, no pin, no counters)."""
        namespace = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        def build(key: Optional[NamespaceKey]) -> Rpc:
            request = self._match_request(
                namespace, key, prompt, requester_agent_id, pin, lease_ttl_ms, probe
            )
            return Rpc("Match", request, deadline)

        response = yield from self._send_prompt(namespace, prompt, build)
        return _convert.match_from_proto(response)

    @command
    def route(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        *,
        page_hashes: Optional[PageHashesLike] = None,
        candidates: Sequence[Union[RouteCandidate, str]] = (),
        policy: RoutePolicy = RoutePolicy.PREFILL_SAVED,
        prefill_tokens_per_s: float = 0.0,
        probe: bool = False,
        pin: bool = False,
        lease_ttl_ms: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> Command[RouteResult]:
        """Candidate agents ranked by the prefill each would save (or a cache-blind
        policy), and the match for the best. Empty candidates: every live agent."""
        namespace = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)

        def build(key: Optional[NamespaceKey]) -> Rpc:
            request = self._route_request(
                namespace,
                key,
                prompt,
                candidates,
                policy,
                prefill_tokens_per_s,
                probe,
                pin,
                lease_ttl_ms,
            )
            return Rpc("Route", request, deadline)

        response = yield from self._send_prompt(namespace, prompt, build)
        return _convert.route_from_proto(response)

    @command
    def insert(
        self,
        ns: NamespaceLike,
        tokens: Any = None,
        pool: Optional[PoolLike] = None,
        block_ids: Iterable[int] = (),
        *,
        page_hashes: Optional[PageHashesLike] = None,
        use_reservation: bool = False,
        agent_epoch: int = 0,
        deadline_ms: Optional[int] = None,
    ) -> Command[InsertResult]:
        """Records that `pool` holds the whole pages of the prompt in `block_ids` (one per
        whole page, distinct). Idempotent. In an agent's pool the blocks must be allocated
        to `ns` in `agent_epoch` (BlockAgent.Allocate); see CacheManager.Insert."""
        if pool is None:
            raise InvalidArgument("pool: is required")
        namespace = as_namespace(ns)
        prompt = Prompt.of(tokens, page_hashes)
        deadline = self._deadline(deadline_ms)
        ids = list(block_ids)

        def build(key: Optional[NamespaceKey]) -> Rpc:
            request = self._insert_request(
                namespace, key, prompt, pool, ids, use_reservation, agent_epoch
            )
            return Rpc("Insert", request, deadline)

        response = yield from self._send_prompt(namespace, prompt, build)
        return _convert.insert_from_proto(response)

    @command
    def release(
        self, ns: NamespaceLike, pin_id: int, *, deadline_ms: Optional[int] = None
    ) -> Command[None]:
        """Drops a pin. NotFound for an unknown pin (also a retried Release whose first
        attempt landed), Aborted for an expired one."""
        request = self._pin_request(as_namespace(ns), pin_id)
        yield Rpc("Release", request, self._deadline(deadline_ms))

    @command
    def renew_lease(
        self, ns: NamespaceLike, pin_id: int, ttl_ms: int = 0, *, deadline_ms: Optional[int] = None
    ) -> Command[int]:
        """Extends a pin's lease to now + ttl_ms (0: the manager's default); returns the new
        expiry in unix milliseconds."""
        request = self._renew_request(as_namespace(ns), pin_id, ttl_ms)
        response = yield Rpc("RenewLease", request, self._deadline(deadline_ms))
        return int(response.lease_expiry_unix_ms)

    @command
    def reserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> Command[int]:
        """Makes `nbytes` of `pool` free (evicting exactly the shortfall) and holds them for
        `tenant` (a worker: its own; "" an admin's operator reservation). Returns the bytes
        evicted. ResourceExhausted, nothing changed, when pins leave too little."""
        request = self._reserve_request(pool, nbytes, tenant)
        response = yield Rpc("Reserve", request, self._deadline(deadline_ms))
        return int(response.evicted_bytes)

    @command
    def unreserve(
        self, pool: PoolLike, nbytes: int, *, tenant: str = "", deadline_ms: Optional[int] = None
    ) -> Command[None]:
        """Gives reserved headroom back. OutOfRange beyond what `tenant` reserved there."""
        request = self._reserve_request(pool, nbytes, tenant)
        yield Rpc("Unreserve", request, self._deadline(deadline_ms))

    @command
    def evict_from_pool(
        self, pool: PoolLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> Command[EvictResult]:
        """Evicts at least `nbytes` of unpinned pages from `pool`, all or nothing."""
        request = self._evict_pool_request(pool, nbytes)
        response = yield Rpc("Evict", request, self._deadline(deadline_ms))
        return _convert.evict_from_proto(response)

    @command
    def evict_from_namespace(
        self, ns: NamespaceLike, nbytes: int, *, deadline_ms: Optional[int] = None
    ) -> Command[EvictResult]:
        """Evicts at least `nbytes` of unpinned pages of `ns`, all or nothing."""
        request = self._evict_namespace_request(as_namespace(ns), nbytes)
        response = yield Rpc("Evict", request, self._deadline(deadline_ms))
        return _convert.evict_from_proto(response)

    @command
    def delete_namespace(
        self, ns: NamespaceLike, *, deadline_ms: Optional[int] = None
    ) -> Command[DeleteNamespaceResult]:
        """Operator (role admin): removes a namespace with its pages and pins. This client
        forgets its hash key, so it does not re-create the namespace by itself."""
        namespace = as_namespace(ns)
        request = self._delete_request(namespace)
        response = yield Rpc("DeleteNamespace", request, self._deadline(deadline_ms))
        self._forget_key(namespace)
        return DeleteNamespaceResult(response.removed_pages, response.dropped_pins)

    @command
    def forget_agent(
        self, agent_id: str, *, force: bool = False, deadline_ms: Optional[int] = None
    ) -> Command[ForgetAgentResult]:
        """Operator (role admin): forgets a gone agent now instead of after the manager's
        gone_agent_memory_s. NotFound for an unknown agent; FailedPrecondition for a live one
        unless `force`."""
        request = pb.ForgetAgentRequest(agent_id=agent_id, force=force)
        response = yield Rpc("ForgetAgent", request, self._deadline(deadline_ms))
        return ForgetAgentResult(
            int(response.epoch), bool(response.was_alive), int(response.dropped_pages)
        )

    @command
    def stats(self, *, deadline_ms: Optional[int] = None) -> Command[Stats]:
        """Pools, namespaces, agents, tenants, counters and limits."""
        response = yield Rpc("Stats", pb.StatsRequest(), self._deadline(deadline_ms))
        return _convert.stats_from_proto(response)


__all__ = ["Command", "Commands", "Rpc", "bind_commands", "command"]
