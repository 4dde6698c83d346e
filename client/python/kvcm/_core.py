"""What the sync and async clients share: the cache of namespace hash keys, counters, and
building requests (kvcm._options has the options, credentials and retry schedule). Internal.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from kvcm import hashing
from kvcm._convert import namespace_to_proto, pool_to_proto, spec_to_proto
from kvcm._options import (
    ClientOptions,
    channel_credentials,
    channel_options,
    default_manager_address,
    final_error,
    resolve_token,
)
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc
from kvcm._proto.v1 import common_pb2 as common_pb
from kvcm.errors import FailedPrecondition, InvalidArgument, KvcmError, error_for
from kvcm.types import (
    ClientCounters,
    ModelSpec,
    Namespace,
    NamespaceLike,
    PoolLike,
    RegisterModelResult,
    RouteCandidate,
    RoutePolicy,
    as_namespace,
    as_pool,
)

PageHashesLike = Union[bytes, bytearray, memoryview, Sequence[bytes]]


def is_stale_key(e: KvcmError) -> bool:
    """The manager refused our hashes: its secret or scheme changed (FAILED_PRECONDITION
    about prompt.scheme) or it forgot the namespace (NOT_FOUND, a restart). Other
    FAILED_PRECONDITIONs (an agent refusing an Insert's blocks) are answers, not staleness."""
    return e.code == grpc.StatusCode.NOT_FOUND or (
        e.code == grpc.StatusCode.FAILED_PRECONDITION and e.message.startswith("prompt.scheme")
    )


@dataclass(frozen=True)
class NamespaceKey:
    """A namespace's hash key as RegisterModel gave it, and what re-registers it."""

    key: bytes = field(repr=False)
    fingerprint: int
    page_size_tokens: int
    spec: ModelSpec
    max_page_age_s: int


@dataclass(frozen=True)
class Prompt:
    """A call's prompt: tokens (hashed locally when the key is known) or page hashes."""

    tokens: Any = None
    page_hashes: Optional[bytes] = None

    @staticmethod
    def of(tokens: Any, page_hashes: Optional[PageHashesLike]) -> "Prompt":
        if (tokens is None) == (page_hashes is None):
            raise InvalidArgument("prompt: give exactly one of tokens or page_hashes")
        if page_hashes is None:
            return Prompt(tokens=tokens)
        if isinstance(page_hashes, (bytes, bytearray, memoryview)):
            wire = bytes(page_hashes)
            if len(wire) % 16 != 0:
                raise InvalidArgument(
                    f"page_hashes: length must be a multiple of 16, got {len(wire)}"
                )
        else:
            try:
                wire = hashing.encode_page_hashes(page_hashes)
            except ValueError as e:
                raise InvalidArgument(f"page_{e}") from None
        return Prompt(page_hashes=wire)


def new_message(cls: Any, **fields: Any) -> Any:
    """cls(**fields), with InvalidArgument naming the field a value does not fit."""
    message = cls()
    for name, value in fields.items():
        try:
            setattr(message, name, value)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{name}: {e}") from None
    return message


def _token_ids(tokens: Any) -> Iterable[int]:
    if isinstance(tokens, (list, tuple)):
        return tokens
    import array

    ids = array.array("i")
    ids.frombytes(hashing.pure.token_bytes(tokens))
    return ids


def _renamed(old: str, old_value: Optional[str], new: str,
             new_value: Optional[str]) -> Optional[str]:
    """`new`'s value, taking the deprecated keyword `old`'s when only it is given."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise InvalidArgument(f"{new}: given twice, also as its old name {old}")
    warnings.warn(f"kvcm.Client({old}=...) is deprecated; use {new}=", DeprecationWarning,
                  stacklevel=4)
    return old_value


class ClientCore:
    """State and request building shared by kvcm.Client and kvcm.aio.Client.

    Thread-safe: the key cache and counters are locked."""

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        insecure: bool = False,
        tls_ca_file: Optional[str] = None,
        tls_cert_file: Optional[str] = None,
        tls_key_file: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        default_deadline_ms: int = ClientOptions.default_deadline_ms,
        max_attempts: int = ClientOptions.max_attempts,
        initial_backoff_ms: int = ClientOptions.initial_backoff_ms,
        max_backoff_ms: int = ClientOptions.max_backoff_ms,
        backoff_multiplier: float = ClientOptions.backoff_multiplier,
        non_idempotent_max_attempts: int = ClientOptions.non_idempotent_max_attempts,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
    ) -> None:
        # ca_file, cert_file and key_file: the names before the CLI's and the configs'
        # tls_* vocabulary; still accepted, with a DeprecationWarning.
        tls_ca_file = _renamed("ca_file", ca_file, "tls_ca_file", tls_ca_file)
        tls_cert_file = _renamed("cert_file", cert_file, "tls_cert_file", tls_cert_file)
        tls_key_file = _renamed("key_file", key_file, "tls_key_file", tls_key_file)
        self.options = ClientOptions(
            address=default_manager_address() if address is None else address,
            default_deadline_ms=default_deadline_ms,
            max_attempts=max_attempts,
            initial_backoff_ms=initial_backoff_ms,
            max_backoff_ms=max_backoff_ms,
            backoff_multiplier=backoff_multiplier,
            non_idempotent_max_attempts=non_idempotent_max_attempts,
            tls_ca_file=tls_ca_file or "",
            tls_cert_file=tls_cert_file or "",
            tls_key_file=tls_key_file or "",
            insecure=insecure,
            token=resolve_token(token, token_file),
        )
        self.options.validate()
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.options.token}"),) if self.options.token else ()
        )
        self._lock = threading.Lock()
        self._keys: dict[Namespace, NamespaceKey] = {}
        self._calls = self._attempts = self._retries = 0
        self._channel = self._open_channel(
            channel_credentials(self.options), channel_options(self.options)
        )
        self._stub = pb_grpc.CacheManagerStub(self._channel)

    def _open_channel(
        self, credentials: Optional[grpc.ChannelCredentials], options: List[Tuple[str, Any]]
    ) -> Any:
        """The grpc (or grpc.aio) channel to options.address; None credentials: plaintext."""
        raise NotImplementedError

    def _final_error(self, e: grpc.RpcError, attempts: int) -> KvcmError:
        return final_error(e, attempts, self.options.insecure)

    # -- counters -----------------------------------------------------------------------

    @property
    def counters(self) -> ClientCounters:
        with self._lock:
            return ClientCounters(self._calls, self._attempts, self._retries)

    def _count(self, calls: int = 0, attempts: int = 0, retries: int = 0) -> None:
        with self._lock:
            self._calls += calls
            self._attempts += attempts
            self._retries += retries

    def _deadline_s(self, deadline_ms: Optional[int]) -> float:
        ms = deadline_ms if deadline_ms is not None and deadline_ms > 0 else None
        return (ms or self.options.default_deadline_ms) / 1000.0

    # -- hash keys ----------------------------------------------------------------------

    def hashes_locally(self, ns: NamespaceLike) -> bool:
        """Whether this client holds the hash key of `ns` (RegisterModel succeeded on it)."""
        return self._cached_key(as_namespace(ns)) is not None

    def hash_prompt(self, ns: NamespaceLike, tokens: Any) -> List[bytes]:
        """Page hashes of `tokens` with the cached key of `ns` (trailing partial page
        ignored). FailedPrecondition when RegisterModel was not called for `ns`."""
        key = self._require_key(as_namespace(ns))
        return hashing.hash_pages(key.key, tokens, key.page_size_tokens)

    def hashed_prompt(self, ns: NamespaceLike, page_hashes: Sequence[bytes]) -> common_pb.Prompt:
        """A kvcm.v1.Prompt of page hashes (from hash_prompt) with the scheme of `ns`, for
        requests the Client does not wrap (e.g. BlockAgent.Fetch). FailedPrecondition when
        RegisterModel was not called for `ns`."""
        key = self._require_key(as_namespace(ns))
        out = common_pb.Prompt()
        self._fill_prompt(out, key, Prompt.of(None, list(page_hashes)))
        return out

    def _cached_key(self, ns: Namespace) -> Optional[NamespaceKey]:
        with self._lock:
            return self._keys.get(ns)

    def _require_key(self, ns: Namespace) -> NamespaceKey:
        key = self._cached_key(ns)
        if key is None:
            raise FailedPrecondition(
                f"no hash key for namespace {ns}: call register_model before sending page hashes"
            )
        return key

    def _forget_key(self, ns: Namespace) -> None:
        with self._lock:
            self._keys.pop(ns, None)

    def _register_request(
        self, ns: Namespace, spec: ModelSpec, max_page_age_s: int
    ) -> pb.RegisterModelRequest:
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument(f"spec: expected kvcm.ModelSpec, got {type(spec).__name__}")
        request = new_message(pb.RegisterModelRequest, max_page_age_s=max_page_age_s)
        namespace_to_proto(ns, request.namespace)
        spec_to_proto(spec, request.spec)
        return request

    def _registered(
        self,
        ns: Namespace,
        spec: ModelSpec,
        max_page_age_s: int,
        response: pb.RegisterModelResponse,
    ) -> RegisterModelResult:
        """Caches the key when this build provably hashes like the manager: the same
        scheme version and a fingerprint that matches the key. Otherwise prompts go as
        tokens."""
        from kvcm._convert import spec_from_proto

        scheme = response.scheme
        key = bytes(response.hash_key)
        with self._lock:
            if (
                len(key) == 16
                and scheme.version == hashing.PAGE_HASH_VERSION
                and scheme.page_size_tokens > 0
                and hashing.key_fingerprint(key) == scheme.key_fingerprint
            ):
                self._keys[ns] = NamespaceKey(
                    key, scheme.key_fingerprint, scheme.page_size_tokens, spec, max_page_age_s
                )
            else:
                self._keys.pop(ns, None)
        return RegisterModelResult(
            spec=spec_from_proto(response.spec),
            bytes_per_token=response.bytes_per_token,
            bytes_per_page=response.bytes_per_page,
            key_fingerprint=scheme.key_fingerprint,
            created=response.created,
            max_page_age_s=response.max_page_age_s,
        )

    # -- requests -----------------------------------------------------------------------

    @staticmethod
    def _fill_prompt(out: common_pb.Prompt, key: Optional[NamespaceKey], prompt: Prompt) -> None:
        if prompt.page_hashes is not None or key is not None:
            assert key is not None
            if prompt.page_hashes is not None:
                out.page_hashes = prompt.page_hashes
            else:
                out.page_hashes = b"".join(
                    hashing.hash_pages(key.key, prompt.tokens, key.page_size_tokens)
                )
            out.scheme.version = hashing.PAGE_HASH_VERSION
            out.scheme.page_size_tokens = key.page_size_tokens
            out.scheme.key_fingerprint = key.fingerprint
        else:
            try:
                out.tokens.ids.extend(_token_ids(prompt.tokens))
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"tokens: {e}") from None

    def _prompt_key(self, ns: Namespace, prompt: Prompt) -> Optional[NamespaceKey]:
        """The key a prompt is sent with: required for page hashes, optional for tokens."""
        return self._require_key(ns) if prompt.page_hashes is not None else self._cached_key(ns)

    def _match_request(
        self,
        ns: Namespace,
        key: Optional[NamespaceKey],
        prompt: Prompt,
        requester_agent_id: str,
        pin: bool,
        lease_ttl_ms: int,
        probe: bool,
    ) -> pb.MatchRequest:
        request = new_message(
            pb.MatchRequest,
            requester_agent_id=requester_agent_id,
            pin=pin,
            lease_ttl_ms=lease_ttl_ms,
            probe=probe,
        )
        namespace_to_proto(ns, request.namespace)
        self._fill_prompt(request.prompt, key, prompt)
        return request

    def _route_request(
        self,
        ns: Namespace,
        key: Optional[NamespaceKey],
        prompt: Prompt,
        candidates: Sequence[Union[RouteCandidate, str]],
        policy: RoutePolicy,
        prefill_tokens_per_s: float,
        probe: bool,
        pin: bool,
        lease_ttl_ms: int,
    ) -> pb.RouteRequest:
        request = new_message(
            pb.RouteRequest,
            policy=int(RoutePolicy(policy)),
            prefill_tokens_per_s=prefill_tokens_per_s,
            probe=probe,
            pin=pin,
            lease_ttl_ms=lease_ttl_ms,
        )
        namespace_to_proto(ns, request.namespace)
        self._fill_prompt(request.prompt, key, prompt)
        for i, c in enumerate(candidates):
            if isinstance(c, str):
                c = RouteCandidate(c)
            if not isinstance(c, RouteCandidate):
                raise InvalidArgument(f"candidates[{i}]: expected RouteCandidate or agent id")
            try:
                request.candidates.add(
                    agent_id=c.agent_id, load=c.load, queued_prefill_tokens=c.queued_prefill_tokens
                )
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"candidates[{i}]: {e}") from None
        return request

    def _insert_request(
        self,
        ns: Namespace,
        key: Optional[NamespaceKey],
        prompt: Prompt,
        pool: PoolLike,
        block_ids: Iterable[int],
        use_reservation: bool,
        agent_epoch: int,
    ) -> pb.InsertRequest:
        request = new_message(
            pb.InsertRequest, use_reservation=use_reservation, agent_epoch=agent_epoch
        )
        namespace_to_proto(ns, request.namespace)
        pool_to_proto(as_pool(pool), request.pool)
        try:
            request.block_ids.extend(block_ids)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"block_ids: {e}") from None
        self._fill_prompt(request.prompt, key, prompt)
        return request

    @staticmethod
    def _pin_request(ns: Namespace, pin_id: int) -> pb.ReleaseRequest:
        request = new_message(pb.ReleaseRequest, pin_id=pin_id)
        namespace_to_proto(ns, request.namespace)
        return request

    @staticmethod
    def _renew_request(ns: Namespace, pin_id: int, ttl_ms: int) -> pb.RenewLeaseRequest:
        request = new_message(pb.RenewLeaseRequest, pin_id=pin_id, lease_ttl_ms=ttl_ms)
        namespace_to_proto(ns, request.namespace)
        return request

    @staticmethod
    def _reserve_request(pool: PoolLike, nbytes: int, tenant: str) -> pb.ReserveRequest:
        request = new_message(pb.ReserveRequest, bytes=nbytes, tenant=tenant)
        pool_to_proto(as_pool(pool), request.pool)
        return request

    @staticmethod
    def _evict_pool_request(pool: PoolLike, nbytes: int) -> pb.EvictRequest:
        request = new_message(pb.EvictRequest, bytes=nbytes)
        pool_to_proto(as_pool(pool), request.pool)
        return request

    @staticmethod
    def _evict_namespace_request(ns: Namespace, nbytes: int) -> pb.EvictRequest:
        request = new_message(pb.EvictRequest, bytes=nbytes)
        namespace_to_proto(ns, request.namespace)
        return request

    @staticmethod
    def _delete_request(ns: Namespace) -> pb.DeleteNamespaceRequest:
        request = pb.DeleteNamespaceRequest()
        namespace_to_proto(ns, request.namespace)
        return request

    @staticmethod
    def _watch_request(ns: Optional[NamespaceLike]) -> pb.WatchEventsRequest:
        request = pb.WatchEventsRequest()
        if ns is not None:
            namespace_to_proto(as_namespace(ns), request.namespace)
        return request


def stale_refresh_error(e: KvcmError, ns: Namespace, refresh: KvcmError) -> KvcmError:
    """The original refusal, saying why re-registering did not fix it."""
    return error_for(
        e.code, f"{e.message}; re-registering namespace {ns} failed: {refresh.message}"
    )
