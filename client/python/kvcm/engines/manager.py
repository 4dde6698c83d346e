"""The bridge's two manager calls, RegisterModel and PublishEngineEvents, over grpc.aio.

Each call carries the caller's bearer token, so one channel serves every engine. Errors are
grpc.aio.AioRpcError; the bridge decides what they mean (kvcm.engines.session.classify).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc
from kvcm._proto.v1 import common_pb2
from kvcm.types import ModelSpec
from kvcm.engines.session import PublishRequest

# grpc's default receive limit (4 MiB) is below what a snapshot request may reach.
_MAX_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class Registration:
    hash_key: bytes = b""
    version: int = 0
    page_size: int = 0
    key_fingerprint: int = 0


@dataclass(frozen=True)
class PublishResult:
    stored_pages: int
    removed_pages: int
    pages: int


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path!r}: {e.strerror}") from None


class ManagerConnection:
    """One channel to the manager. Safe to share between the engines of one event loop."""

    def __init__(self, address: str, *, insecure: bool = False, tls_ca_file: str = "",
                 tls_cert_file: str = "", tls_key_file: str = "", deadline_ms: int = 5000):
        opts = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000)]
        if insecure:
            self._channel = grpc.aio.insecure_channel(address, options=opts)
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file, "tls_ca_file"),
                private_key=_read(tls_key_file, "tls_key_file") if tls_key_file else None,
                certificate_chain=_read(tls_cert_file, "tls_cert_file") if tls_cert_file else None)
            self._channel = grpc.aio.secure_channel(address, creds, options=opts)
        self._stub = pb_grpc.CacheManagerStub(self._channel)
        self._timeout_s = deadline_ms / 1000

    async def close(self) -> None:
        await self._channel.close()

    @staticmethod
    def _metadata(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),) if token else ()

    async def register(self, tenant: str, model: str, spec: ModelSpec, token: str,
                       max_page_age_s: int = 0) -> Registration:
        req = pb.RegisterModelRequest(max_page_age_s=max_page_age_s)
        req.namespace.tenant, req.namespace.model = tenant, model
        s = req.spec
        s.attention = int(spec.attention)  # type: ignore[assignment]
        s.num_layers, s.num_heads = spec.num_layers, spec.num_heads
        s.num_kv_heads, s.head_dim = spec.num_kv_heads, spec.head_dim
        s.kv_lora_rank, s.rope_dim = spec.kv_lora_rank, spec.rope_dim
        s.dtype = int(spec.dtype)  # type: ignore[assignment]
        s.page_size_tokens = spec.page_size_tokens
        s.qk_nope_head_dim, s.v_head_dim = spec.qk_nope_head_dim, spec.v_head_dim
        s.kv_layout = spec.kv_layout
        resp = await self._stub.RegisterModel(req, timeout=self._timeout_s,
                                              metadata=self._metadata(token))
        return Registration(bytes(resp.hash_key), resp.scheme.version,
                            resp.scheme.page_size_tokens, resp.scheme.key_fingerprint)

    async def publish(self, engine_id: str, tenant: str, model: str, reg: Registration,
                      request: PublishRequest, ttl_ms: int, token: str) -> PublishResult:
        req = pb.PublishEngineEventsRequest(
            engine_id=engine_id, session=request.session, sequence=request.sequence,
            ttl_ms=ttl_ms, close=request.close,
            scheme=common_pb2.HashScheme(version=reg.version, page_size_tokens=reg.page_size,
                                         key_fingerprint=reg.key_fingerprint),
            changes=[pb.EngineChange(kind=int(c.kind), tier=int(c.tier),  # type: ignore[arg-type]
                                     page_hashes=c.page_hashes) for c in request.changes])
        req.namespace.tenant, req.namespace.model = tenant, model
        resp = await self._stub.PublishEngineEvents(req, timeout=self._timeout_s,
                                                    metadata=self._metadata(token))
        return PublishResult(resp.stored_pages, resp.removed_pages, resp.pages)
