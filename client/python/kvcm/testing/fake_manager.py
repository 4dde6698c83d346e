"""An in-process stand-in for kvcm-manager's engine-pool side, for bridge tests.

`FakeEngineManager` serves RegisterModel and PublishEngineEvents over grpc.aio with the
semantics of cache_manager.proto: namespace keys derived from a secret, the hash scheme
checked, sessions that start at sequence 1 (emptying the engine's pools), sequence = last + 1
(the last one again is a duplicate, applied once), FAILED_PRECONDITION naming "sequence"
otherwise, sessions lapsing after ttl_ms, close, and tokens scoped to an engine and tenant.
It indexes chains as sets of page hashes with parents; `pages()` and `match()` read them.
It is not the manager: a test that needs the real one runs the kvcm-manager binary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from kvcm import hashing
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc


@dataclass
class _Session:
    session: int
    sequence: int
    ttl_s: float
    last: float
    namespace: tuple[str, str]


@dataclass
class _Pool:
    pages: set[bytes] = field(default_factory=set)


class FakeEngineManager(pb_grpc.CacheManagerServicer):
    """`tokens`: token -> (engine_id, tenant): an engine's token, or ("", tenant) a worker's
    (registers, never publishes); None accepts everything."""

    def __init__(self, secret: bytes = bytes(16), tokens: dict[str, tuple[str, str]] | None
                 = None, default_ttl_ms: int = 30_000):
        self.secret = secret
        self.tokens = tokens
        self.default_ttl_ms = default_ttl_ms
        self.namespaces: dict[tuple[str, str], int] = {}   # -> page size
        self.sessions: dict[str, _Session] = {}
        self.pools: dict[tuple[str, int], _Pool] = {}
        self.parent: dict[bytes, bytes | None] = {}
        self.requests: list[pb.PublishEngineEventsRequest] = []
        self.fail_next: list[tuple[grpc.StatusCode, str]] = []  # injected failures
        self._server: grpc.aio.Server | None = None
        self.port = 0

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        self._server = grpc.aio.server()
        pb_grpc.add_CacheManagerServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    def engine_sessions(self) -> set[str]:
        self._expire(time.monotonic())
        return set(self.sessions)

    def restart(self) -> None:
        """What a manager restart loses: every session and engine pool (namespaces stay:
        their keys derive from the secret)."""
        self.sessions.clear()
        self.pools.clear()

    # ---- reading ----------------------------------------------------------------------

    def pages(self, engine_id: str, tier: int = 1) -> set[bytes]:
        self._expire(time.monotonic())
        pool = self.pools.get((engine_id, tier))
        return set(pool.pages) if pool else set()

    def match(self, engine_id: str, page_hashes: list[bytes], tier: int = 1) -> int:
        """Leading pages of the prompt the engine's pool holds."""
        self._expire(time.monotonic())
        pool = self.pools.get((engine_id, tier))
        held = pool.pages if pool else set()
        n = 0
        while n < len(page_hashes) and page_hashes[n] in held:
            n += 1
        return n

    def key(self, tenant: str, model: str) -> bytes:
        return hashing.namespace_key(self.secret, tenant, model)

    # ---- RPCs -------------------------------------------------------------------------

    def _auth(self, context: grpc.aio.ServicerContext) -> tuple[str, str] | None:
        if self.tokens is None:
            return None
        md = dict(context.invocation_metadata() or ())
        auth = md.get("authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        if token not in self.tokens:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        return self.tokens[token]

    async def RegisterModel(self, request, context):  # noqa: N802
        try:
            who = self._auth(context)
            ns = (request.namespace.tenant, request.namespace.model)
            if who is not None and who[1] != ns[0]:
                raise _Abort(grpc.StatusCode.PERMISSION_DENIED, f"not a worker of {ns[0]}")
            page = request.spec.page_size_tokens or 64
            if self.namespaces.setdefault(ns, page) != page:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "a different spec")
        except _Abort as a:
            await context.abort(a.code, a.message)
        key = self.key(*ns)
        resp = pb.RegisterModelResponse(hash_key=key, created=True)
        resp.spec.CopyFrom(request.spec)
        resp.spec.page_size_tokens = page
        resp.scheme.version = 1
        resp.scheme.page_size_tokens = page
        resp.scheme.key_fingerprint = hashing.key_fingerprint(key)
        return resp

    async def PublishEngineEvents(self, request, context):  # noqa: N802
        self.requests.append(request)
        try:
            if self.fail_next:
                raise _Abort(*self.fail_next.pop(0))
            who = self._auth(context)
            return self._publish(request, who, time.monotonic())
        except _Abort as a:
            await context.abort(a.code, a.message)

    def _publish(self, r, who, now: float) -> pb.PublishEngineEventsResponse:
        ns = (r.namespace.tenant, r.namespace.model)
        if who is not None and (who[0] != r.engine_id or who[1] != ns[0]):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"may not publish as engine {r.engine_id} of {ns[0]}")
        if ns not in self.namespaces:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"namespace {ns[0]}/{ns[1]}")
        if r.scheme.page_size_tokens != self.namespaces[ns]:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "scheme.page_size_tokens")
        if r.scheme.key_fingerprint != hashing.key_fingerprint(self.key(*ns)):
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         "scheme.key_fingerprint is not the namespace key's")
        if r.session == 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "session: must be non-zero")
        self._expire(now)
        s = self.sessions.get(r.engine_id)
        if s is None or s.session != r.session:
            if r.sequence != 1:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"unknown session: sequence {r.sequence} must be 1")
            self._drop(r.engine_id)
            s = _Session(r.session, 0, (r.ttl_ms or self.default_ttl_ms) / 1000, now, ns)
            self.sessions[r.engine_id] = s
        elif r.sequence == s.sequence:
            s.last = now
            return pb.PublishEngineEventsResponse(pages=self._count(r.engine_id))
        elif r.sequence != s.sequence + 1:
            del self.sessions[r.engine_id]
            self._drop(r.engine_id)
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"sequence {r.sequence}, expected {s.sequence + 1}")
        s.sequence, s.last = r.sequence, now
        stored = removed = 0
        for c in r.changes:
            pool = self.pools.setdefault((r.engine_id, c.tier), _Pool())
            hs = [c.page_hashes[i:i + 16] for i in range(0, len(c.page_hashes), 16)]
            if c.kind == pb.EngineChange.KIND_CLEARED:
                removed += len(pool.pages)
                pool.pages.clear()
            elif c.kind == pb.EngineChange.KIND_STORED:
                for i, h in enumerate(hs):
                    self.parent[h] = hs[i - 1] if i else None
                    if h not in pool.pages:
                        pool.pages.add(h)
                        stored += 1
            elif c.kind == pb.EngineChange.KIND_REMOVED and hs and hs[-1] in pool.pages:
                gone = {hs[-1]}
                grew = True
                while grew:
                    more = {h for h in pool.pages if self.parent.get(h) in gone} - gone
                    grew = bool(more)
                    gone |= more
                removed += len(gone & pool.pages)
                pool.pages -= gone
        if r.close:
            del self.sessions[r.engine_id]
            self._drop(r.engine_id)
        return pb.PublishEngineEventsResponse(stored_pages=stored, removed_pages=removed,
                                              pages=self._count(r.engine_id))

    def _count(self, engine_id: str) -> int:
        return sum(len(p.pages) for (e, _), p in self.pools.items() if e == engine_id)

    def _drop(self, engine_id: str) -> None:
        for k in [k for k in self.pools if k[0] == engine_id]:
            del self.pools[k]

    def _expire(self, now: float) -> None:
        for eid, s in list(self.sessions.items()):
            if now - s.last > s.ttl_s:
                del self.sessions[eid]
                self._drop(eid)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message
