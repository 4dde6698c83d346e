"""A fake vLLM engine publishing over loopback ZMQ, a kvcm-vllm-bridge, and a view of the
manager's engine pools (in-process fake or real process), for tests and benchmarks.

    rig = BridgeRig(FakeManagerView(fake), form="map", mode="connect")
    rig.engine.process(tokens); rig.pub.flush()
    await rig.converge()       # the manager holds exactly what the engine holds
    await rig.close()

Must be created inside a running asyncio loop (the bridge runs as a task of it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from kvcm import hashing
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc
from kvcm.testing.fake_manager import FakeEngineManager
from kvcm.testing.fake_vllm import FakeVllmEngine, FakeVllmPublisher
from kvcm.engines.bridge import Bridge
from kvcm.engines.config import BridgeConfig, EngineConfig, NamespaceConfig
from kvcm.engines.pagehash import hash_request, page_hash
from rigs.manager import ManagerProcess, free_port

GPU = 1


class ManagerView(Protocol):
    address: str
    secret: bytes

    async def pool_pages(self, engine_id: str, tier: int = GPU) -> int: ...

    async def engine_prefix(self, tenant: str, model: str, page_size: int, engine_id: str,
                            hashes: list[bytes], tier: int = GPU) -> int: ...

    async def engine_sessions(self) -> set[str]: ...

    async def restart(self) -> None: ...


class FakeManagerView:
    def __init__(self, fake: FakeEngineManager):
        self.fake = fake
        self.address = f"127.0.0.1:{fake.port}"
        self.secret = fake.secret

    async def engine_sessions(self) -> set[str]:
        return self.fake.engine_sessions()

    async def engine_prefix_tokens(self, tenant: str, model: str, page_size: int,
                                   engine_id: str, tokens: list[int], tier: int = GPU) -> int:
        key = self.fake.key(tenant, model)
        return self.fake.match(engine_id, hashing.hash_pages(key, tokens, page_size), tier)

    async def restart(self) -> None:
        self.fake.restart()

    async def pool_pages(self, engine_id: str, tier: int = GPU) -> int:
        return len(self.fake.pages(engine_id, tier))

    async def engine_prefix(self, tenant: str, model: str, page_size: int, engine_id: str,
                            hashes: list[bytes], tier: int = GPU) -> int:
        return self.fake.match(engine_id, hashes, tier)


class RealManagerView:
    """Reads a kvcm-manager with Stats and probe Matches (`token`: one that may do both)."""

    def __init__(self, process: ManagerProcess, token: str = ""):
        self.process = process
        self.address, self.secret = process.address, process.secret
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        if process.tls is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        else:
            self._channel = grpc.aio.secure_channel(
                self.address, process.credentials(process.tls[:2]))
        self._stub = pb_grpc.CacheManagerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def engine_sessions(self) -> set[str]:
        st = await self._stub.Stats(pb.StatsRequest(), metadata=self._md, timeout=5)
        return {e.engine_id for e in st.engines}

    async def restart(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.process.restart)

    async def pool_pages(self, engine_id: str, tier: int = GPU) -> int:
        st = await self._stub.Stats(pb.StatsRequest(), metadata=self._md, timeout=5)
        return sum(p.pages for p in st.pools
                   if p.pool.agent_id == engine_id and p.pool.tier == tier)

    async def engine_prefix(self, tenant: str, model: str, page_size: int, engine_id: str,
                            hashes: list[bytes], tier: int = GPU) -> int:
        req = pb.MatchRequest(probe=True)
        req.prompt.page_hashes = b"".join(hashes)
        req.prompt.scheme.version = 1
        req.prompt.scheme.page_size_tokens = page_size
        req.prompt.scheme.key_fingerprint = hashing.key_fingerprint(
            hashing.namespace_key(self.secret, tenant, model))
        return await self._match(req, tenant, model, engine_id, tier)

    async def engine_prefix_tokens(self, tenant: str, model: str, page_size: int,
                                   engine_id: str, tokens: list[int], tier: int = GPU) -> int:
        """Leading pages of a prompt sent as tokens (the manager hashes) the engine holds."""
        req = pb.MatchRequest(probe=True)
        req.prompt.tokens.ids.extend(tokens)
        return await self._match(req, tenant, model, engine_id, tier)

    async def route(self, tenant: str, model: str, tokens: list[int],
                    candidates: list[str]) -> list[tuple[str, int]]:
        """(agent or engine id, cached pages), best first, of a probe Route by tokens."""
        req = pb.RouteRequest(probe=True)
        req.namespace.tenant, req.namespace.model = tenant, model
        req.prompt.tokens.ids.extend(tokens)
        for c in candidates:
            req.candidates.add(agent_id=c)
        resp = await self._stub.Route(req, metadata=self._md, timeout=5)
        return [(r.agent_id, r.cached_pages) for r in resp.ranked]

    async def _match(self, req: Any, tenant: str, model: str, engine_id: str,
                     tier: int) -> int:
        req.namespace.tenant, req.namespace.model = tenant, model
        resp = await self._stub.Match(req, metadata=self._md, timeout=5)
        n = 0
        for seg in resp.segments:
            if seg.first_page != n or not any(r.pool.agent_id == engine_id and
                                              r.pool.tier == tier for r in seg.replicas):
                break
            n += seg.num_pages
        return n


class BridgeRig:
    """One fake engine (block size `block_size`) and a bridge publishing it to `view`."""

    TENANT, MODEL = "acme", "llama-3-8b"

    def __init__(self, view: Any, *, form: str = "map", mode: str = "connect",
                 replay: bool = True, buffer_steps: int = 10_000, token: str = "",
                 register_token_file: str = "",
                 history: Callable[[FakeVllmEngine], None] | None = None,
                 engine_id: str = "vllm-0", num_blocks: int = 256, block_size: int = 16,
                 page_size: int = 0, **cfg: Any):
        self.view, self.engine_id, self.block_size = view, engine_id, block_size
        self.page_size = page_size or block_size
        pub_port, replay_port = free_port(), free_port()
        if mode == "connect":  # vLLM binds the wildcard; the bridge connects to its host
            self.vllm_ep, bridge_ep = f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{pub_port}"
        else:                  # vLLM connects to the bridge's host; the bridge binds it
            self.vllm_ep = bridge_ep = f"tcp://127.0.0.1:{pub_port}"
        self.replay_ep = f"tcp://*:{replay_port}" if replay else None
        self.form, self.buffer_steps, self.num_blocks = form, buffer_steps, num_blocks
        self.pub = self.new_publisher()
        self.engine = FakeVllmEngine(block_size, num_blocks, self.pub)
        if history is not None:  # what the engine did before the bridge started
            history(self.engine)
            self.pub.flush()
        opts: dict[str, Any] = dict(manager_address=view.address, insecure=True, ttl_ms=1500,
                                    register_token_file=register_token_file,
                                    engine_timeout_s=1.5, probe_interval_s=0.2,
                                    replay_timeout_s=0.5)
        opts.update(cfg)
        self.cfg = BridgeConfig(
            namespace=NamespaceConfig(tenant=self.TENANT, model=self.MODEL,
                                      preset="llama-3-8b", page_size_tokens=page_size),
            engines=[EngineConfig(id=engine_id, endpoint=bridge_ep, endpoint_mode=mode,
                                  replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
                                  if replay else "", token=token, block_size=block_size)],
            **opts)
        self.bridge = Bridge(self.cfg)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.bridge.run(self.stop))

    def new_publisher(self) -> FakeVllmPublisher:
        return FakeVllmPublisher(self.vllm_ep, self.replay_ep, buffer_steps=self.buffer_steps,
                                 form=self.form)

    def restart_engine(self) -> None:
        """A new publisher and an empty engine on the same endpoints (seq from 0)."""
        self.pub.shutdown()
        self.pub = self.new_publisher()
        self.engine = FakeVllmEngine(self.block_size, self.num_blocks, self.pub)

    @property
    def eb(self):
        return self.bridge.engines[0]

    @property
    def key(self) -> bytes:
        return hashing.namespace_key(self.view.secret, self.TENANT, self.MODEL)

    def hashes(self, tokens, **kw) -> list[bytes]:
        return hash_request(self.key, tokens, self.page_size, self.block_size, **kw)

    def expected_chains(self) -> list[list[bytes]]:
        """One kvcm chain per page the engine holds with all its ancestors."""
        eng, k = self.engine, self.page_size // self.block_size
        cached, out = eng.cached_digests(), []
        for d in cached:
            path: list[bytes] = []
            x: bytes | None = d
            while x is not None and x in cached:
                path.append(x)
                x = eng.meta[x][0]
            if x is None and len(path) % k == 0:
                out.append(self._chain(path[::-1]))
        return out

    def _chain(self, path: list[bytes]) -> list[bytes]:
        """kvcm hashes of the pages of a block path from a prompt start (memoized by the
        path's last block: block hashes name their whole prefix)."""
        memo = self.__dict__.setdefault("_memo", {})
        hit = memo.get(path[-1])
        if hit is None:
            k = self.page_size // self.block_size
            prefix = self._chain(path[:-k]) if len(path) > k else []
            tail = path[-k:]
            eng = self.engine
            toks = [t for p in tail for t in eng.meta[p][1]]
            prev = prefix[-1] if prefix else hashing.ZERO_HASH
            hit = prefix + [page_hash(self.key, prev, toks, [eng.meta[p][2] for p in tail])]
            memo[path[-1]] = hit
        return hit

    async def holds(self, chains: list[list[bytes]]) -> bool:
        """Whether the engine's pool is exactly the pages of `chains`."""
        pages = {h for c in chains for h in c}
        if await self.view.pool_pages(self.engine_id) != len(pages):
            return False
        inner = {h for c in chains for h in c[:-1]}
        for c in chains:
            if c[-1] in inner:
                continue  # a prefix of another chain, checked with it
            if await self.view.engine_prefix(self.TENANT, self.MODEL, self.page_size,
                                             self.engine_id, c) != len(c):
                return False
        return True

    async def converge(self, chains: list[list[bytes]] | None = None,
                       timeout: float = 8.0) -> list[list[bytes]]:
        """Waits until the manager holds what the engine holds (or `chains`)."""
        deadline = time.monotonic() + timeout
        while True:
            want = self.expected_chains() if chains is None else chains
            if await self.holds(want):
                return want
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"manager pool has {await self.view.pool_pages(self.engine_id)} pages, "
                    f"engine {len({h for c in want for h in c})}; stream "
                    f"{self.eb.stream.counters}, session {self.eb.session.counters}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 10)
        self.pub.shutdown()
