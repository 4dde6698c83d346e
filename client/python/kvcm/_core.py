"""What the sync and async clients share: options, credentials, the retry schedule, the
cache of namespace hash keys, and building requests. Internal.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from kvcm import hashing
from kvcm._convert import namespace_to_proto, pool_to_proto, spec_to_proto
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

TOKEN_ENV = "KVCM_TOKEN"
MANAGER_ADDRESS_ENV = "KVCM_MANAGER_ADDRESS"
MANAGER_PORT = 50051
DEFAULT_MANAGER_ADDRESS = f"127.0.0.1:{MANAGER_PORT}"
_TARGET_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")
PageHashesLike = Union[bytes, bytearray, memoryview, Sequence[bytes]]


@dataclass(frozen=True)
class ClientOptions:
    """Connection and retry settings; the same fields and defaults as kvcm::ClientOptions.

    The default retry schedule rides out a manager takeover: a leader that dies is replaced
    once its etcd lease lapses (deploy/k8s: etcd_lease_ttl_s = 5) and a standby is elected,
    so idempotent calls retry UNAVAILABLE for up to ~10 s (backoff 0.1 s doubling to 2 s,
    bounded by the call's deadline). Reserve, Unreserve and Evict are not idempotent (a
    repeat takes more bytes): they make at most non_idempotent_max_attempts attempts.
    """

    # Manager address, "host:port" or a gRPC target with a scheme ("dns:///kvcm:50051").
    # None (the Client's default): $KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051.
    address: str = DEFAULT_MANAGER_ADDRESS
    # Deadline of a call, all its retries included, unless the call gives deadline_ms. > 0.
    default_deadline_ms: int = 10000
    # Attempts per idempotent call, the first included; retried only on UNAVAILABLE. 1..100.
    max_attempts: int = 30
    # Backoff before the first retry, and the channel's initial reconnect backoff. > 0.
    initial_backoff_ms: int = 100
    # Longest backoff between two attempts. >= initial_backoff_ms.
    max_backoff_ms: int = 2000
    # Growth of the backoff per retry. >= 1.
    backoff_multiplier: float = 2.0
    # Attempts per non-idempotent call (Reserve, Unreserve, Evict), at most max_attempts.
    # 1..100.
    non_idempotent_max_attempts: int = 5
    # TLS: ca_file (PEM) verifies the manager; cert_file and key_file (both or neither) are
    # this client's certificate for mutual TLS. insecure=True speaks plaintext and excludes
    # them. One of ca_file or insecure is required. The files are read once, at connect.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    insecure: bool = False
    # Bearer token sent as "authorization: Bearer <token>" with every call; "" sends none.
    token: str = field(default="", repr=False)

    def validate(self) -> None:
        """Raises InvalidArgument naming the first bad field."""
        validate_address(self.address, "address")
        if self.default_deadline_ms <= 0:
            raise InvalidArgument("default_deadline_ms: must be > 0")
        if not 1 <= self.max_attempts <= 100:
            raise InvalidArgument("max_attempts: must be in 1..100")
        if not 1 <= self.non_idempotent_max_attempts <= 100:
            raise InvalidArgument("non_idempotent_max_attempts: must be in 1..100")
        if self.initial_backoff_ms <= 0:
            raise InvalidArgument("initial_backoff_ms: must be > 0")
        if self.max_backoff_ms < self.initial_backoff_ms:
            raise InvalidArgument("max_backoff_ms: must be >= initial_backoff_ms")
        if not self.backoff_multiplier >= 1.0:
            raise InvalidArgument("backoff_multiplier: must be >= 1")
        if self.insecure:
            for name in ("cert_file", "key_file", "ca_file"):
                if getattr(self, name):
                    raise InvalidArgument(f"insecure: excludes {name}")
        else:
            if not self.ca_file:
                raise InvalidArgument(
                    "ca_file: is required to verify the manager (or insecure=True for plaintext)"
                )
            if bool(self.cert_file) != bool(self.key_file):
                missing = "key_file" if self.cert_file else "cert_file"
                raise InvalidArgument(
                    f"{missing}: is required with the other half of the client certificate"
                )
        if self.token:
            validate_token(self.token, "token")


def validate_token(token: str, field_name: str) -> None:
    """Visible ASCII, 1..4096 characters (the manager's ValidateBearerToken)."""
    if not 1 <= len(token) <= 4096:
        raise InvalidArgument(
            f"{field_name}: bearer token must be 1..4096 characters, got {len(token)}"
        )
    if any(not ("!" <= c <= "~") for c in token):
        raise InvalidArgument(
            f"{field_name}: bearer token must be visible ASCII "
            "(no space, control or non-ASCII character)"
        )


def resolve_token(token: Optional[str], token_file: Optional[str]) -> str:
    """token, else the stripped contents of token_file, else $KVCM_TOKEN, else ""."""
    if token and token_file:
        raise InvalidArgument("token_file: give token or token_file, not both")
    if token:
        return token
    if token_file:
        try:
            with open(token_file, encoding="ascii", errors="replace") as f:
                text = f.read().strip()
        except OSError as e:
            raise InvalidArgument(f'token_file "{token_file}": cannot open: {e.strerror}') from None
        validate_token(text, f'token_file "{token_file}"')
        return text
    return os.environ.get(TOKEN_ENV, "")


def default_manager_address() -> str:
    """$KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051: where a client goes when not told."""
    return os.environ.get(MANAGER_ADDRESS_ENV) or DEFAULT_MANAGER_ADDRESS


def validate_address(address: str, name: str, default_port: int = MANAGER_PORT,
                     what: str = "the manager") -> None:
    """InvalidArgument unless `address` is host:port ([v6]:port) or a gRPC target with a
    scheme (dns:///h:p, unix:/path, ipv4:...). A missing port is never a silent :443."""
    if not address:
        raise InvalidArgument(f"{name}: must not be empty (host:port)")
    if ":/" in address or address.split(":", 1)[0] in _TARGET_SCHEMES:
        return  # a gRPC target URI: gRPC validates it
    if address.startswith("["):
        host, sep, port = address.partition("]:")
        host += "]"
    elif address.count(":") > 1:
        raise InvalidArgument(
            f"{name} {address!r}: an IPv6 address needs brackets: [{address}]:{default_port}")
    else:
        host, sep, port = address.rpartition(":")
    if not sep:
        raise InvalidArgument(
            f"{name} {address!r} has no port; {what} listens on {default_port} by default: "
            f"{address}:{default_port}")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidArgument(f"{name} {address!r}: must be host:port with a port in 1..65535")


def _read_pem(path: str, field_name: str, marker: bytes) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidArgument(f'{field_name} "{path}": cannot open: {e.strerror}') from None
    if marker not in data:
        kind = "certificate" if marker == b"CERTIFICATE-----" else "private key"
        raise InvalidArgument(f'{field_name} "{path}": holds no PEM {kind}')
    return data


def channel_credentials(options: ClientOptions) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials from the options' PEM files; None for insecure."""
    if options.insecure:
        return None
    ca = _read_pem(options.ca_file, "ca_file", b"CERTIFICATE-----")
    cert = key = None
    if options.cert_file:
        cert = _read_pem(options.cert_file, "cert_file", b"CERTIFICATE-----")
        key = _read_pem(options.key_file, "key_file", b"PRIVATE KEY-----")
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def channel_options(options: ClientOptions) -> List[Tuple[str, Any]]:
    # Reconnect on the retries' schedule, so that a retry after a refused connection does
    # not find the channel still waiting out gRPC's default 1 s reconnect backoff.
    return [
        ("grpc.initial_reconnect_backoff_ms", int(options.initial_backoff_ms)),
        ("grpc.min_reconnect_backoff_ms", int(options.initial_backoff_ms)),
        ("grpc.max_reconnect_backoff_ms", int(options.max_backoff_ms)),
    ]


class Backoff:
    """Sleeps between attempts: "equal jitter", between half and all of a backoff that
    starts at initial_backoff_ms and grows by backoff_multiplier up to max_backoff_ms."""

    def __init__(self, options: ClientOptions) -> None:
        self._options = options
        self._ms = float(options.initial_backoff_ms)

    @staticmethod
    def attempts(options: ClientOptions, idempotent: bool) -> int:
        """How many attempts a call makes at most."""
        if idempotent:
            return options.max_attempts
        return min(options.max_attempts, options.non_idempotent_max_attempts)

    def next_sleep_s(self) -> float:
        sleep_ms = random.uniform(self._ms / 2, self._ms)
        self._ms = min(self._ms * self._options.backoff_multiplier, self._options.max_backoff_ms)
        return sleep_ms / 1000.0


# UNAVAILABLE details that come from a TLS handshake with a plaintext peer or the reverse.
_HANDSHAKE_SIGNS = ("socket closed", "ssl", "handshake", "tls", "wrong_version_number",
                    "connection reset", "end of tcp stream", "http2 frame", "http/2 frame")


def tls_mismatch_hint(details: str, insecure: bool) -> str:
    """"" unless `details` (an UNAVAILABLE's) looks like a TLS / plaintext mismatch; then
    what this client's side of it should change."""
    text = details.lower()
    if not any(sign in text for sign in _HANDSHAKE_SIGNS):
        return ""
    if insecure:
        return ("; the server may require TLS: pass --tls_ca_file (ca_file=), "
                "or --insecure if it is plaintext")
    return ("; the server may be plaintext: pass --insecure (insecure=True), "
            "or check --tls_ca_file / the server's certificate")


def final_error(e: grpc.RpcError, attempts: int, insecure: Optional[bool] = None) -> KvcmError:
    """The KvcmError for an RPC's last failure, noting retries as the C++ client does, and
    for an UNAVAILABLE that looks like a TLS mismatch (when `insecure` is known) a hint."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (e.details() if callable(getattr(e, "details", None)) else None) or str(e)
    if attempts > 1:
        message = f"{message} (after {attempts} attempts)"
    if insecure is not None and code == grpc.StatusCode.UNAVAILABLE:
        message += tls_mismatch_hint(message, insecure)
    return error_for(code, message)


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


class ClientCore:
    """State and request building shared by kvcm.Client and kvcm.aio.Client.

    Thread-safe: the key cache and counters are locked."""

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        insecure: bool = False,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        default_deadline_ms: int = ClientOptions.default_deadline_ms,
        max_attempts: int = ClientOptions.max_attempts,
        initial_backoff_ms: int = ClientOptions.initial_backoff_ms,
        max_backoff_ms: int = ClientOptions.max_backoff_ms,
        backoff_multiplier: float = ClientOptions.backoff_multiplier,
        non_idempotent_max_attempts: int = ClientOptions.non_idempotent_max_attempts,
    ) -> None:
        self.options = ClientOptions(
            address=default_manager_address() if address is None else address,
            default_deadline_ms=default_deadline_ms,
            max_attempts=max_attempts,
            initial_backoff_ms=initial_backoff_ms,
            max_backoff_ms=max_backoff_ms,
            backoff_multiplier=backoff_multiplier,
            non_idempotent_max_attempts=non_idempotent_max_attempts,
            ca_file=ca_file or "",
            cert_file=cert_file or "",
            key_file=key_file or "",
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
