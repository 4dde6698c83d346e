"""How a client reaches the manager: ClientOptions and their validation, addresses, the
bearer token, TLS credentials, the retry schedule, and the error a failed call raises (with
a hint when it looks like a TLS / plaintext mismatch). Internal; kvcm.ClientOptions is public.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import grpc

from kvcm.errors import InvalidArgument, KvcmError, error_for

TOKEN_ENV = "KVCM_TOKEN"
MANAGER_ADDRESS_ENV = "KVCM_MANAGER_ADDRESS"
MANAGER_PORT = 50051
DEFAULT_MANAGER_ADDRESS = f"127.0.0.1:{MANAGER_PORT}"
_TARGET_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")


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
    # TLS: tls_ca_file (PEM) verifies the manager; tls_cert_file and tls_key_file (both or neither) are
    # this client's certificate for mutual TLS. insecure=True speaks plaintext and excludes
    # them. One of tls_ca_file or insecure is required. The files are read once, at connect.
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
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
            for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
                if getattr(self, name):
                    raise InvalidArgument(f"insecure: excludes {name}")
        else:
            if not self.tls_ca_file:
                raise InvalidArgument(
                    "tls_ca_file: is required to verify the manager (or insecure=True for plaintext)"
                )
            if bool(self.tls_cert_file) != bool(self.tls_key_file):
                missing = "tls_key_file" if self.tls_cert_file else "tls_cert_file"
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
    ca = _read_pem(options.tls_ca_file, "tls_ca_file", b"CERTIFICATE-----")
    cert = key = None
    if options.tls_cert_file:
        cert = _read_pem(options.tls_cert_file, "tls_cert_file", b"CERTIFICATE-----")
        key = _read_pem(options.tls_key_file, "tls_key_file", b"PRIVATE KEY-----")
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


def tls_mismatch_hint(details: str, insecure: bool) -> str:
    """"" unless `details` (an UNAVAILABLE's) looks like a TLS handshake gone wrong; then
    what this client's side of it should change. What gRPC says, measured: a plaintext
    client of a TLS server sees "Socket closed"; a TLS client of a plaintext server "Tls
    handshake failed ... WRONG_VERSION_NUMBER"; a TLS client without a certificate the
    server accepts (mutual TLS) "Socket closed"."""
    text = details.lower()
    if insecure:
        if any(sign in text for sign in ("socket closed", "ssl", "handshake", "tls")):
            return ("; the server may require TLS: pass --tls_ca_file (tls_ca_file=), "
                    "or --insecure if it is plaintext")
        return ""
    if "wrong_version_number" in text or "handshake" in text:
        return ("; the server may be plaintext: pass --insecure (insecure=True), "
                "or check --tls_ca_file and the server's certificate")
    if "socket closed" in text:
        return ("; the server may require a client certificate it trusts: pass "
                "--tls_cert_file and --tls_key_file (tls_cert_file=, tls_key_file=)")
    return ""


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
