"""kvcm-vllm-bridge end to end on loopback: fake vLLM publisher -> bridge -> fake manager.

The same scenarios against the real kvcm-manager are in test_vllm_manager.py.
"""

import asyncio
import socket
import time

import msgspec
import pytest
import pytest_asyncio
from prometheus_client import generate_latest

from kvcm.testing.fake_manager import FakeEngineManager
from kvcm.testing.fake_vllm import FakeVllmEngine, FakeVllmPublisher
from kvcm.vllm.bridge import Bridge
from kvcm.vllm.config import BridgeConfig, EngineConfig, NamespaceConfig
from kvcm.vllm.metrics import registry_for
from kvcm.vllm.pagehash import hash_request

BS = 16
TENANT, MODEL = "acme", "llama-3-8b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


class Rig:
    """A fake engine publishing over ZMQ, a bridge, a fake manager."""

    def __init__(self, mgr, form="map", mode="connect", replay=True, buffer_steps=10_000,
                 token="", engine_id="vllm-0", num_blocks=256, page_size=0, **cfg_kw):
        self.mgr, self.engine_id = mgr, engine_id
        pub_port, replay_port = free_port(), free_port()
        if mode == "connect":  # vLLM binds the wildcard; the bridge connects to its host
            vllm_ep, bridge_ep = f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{pub_port}"
        else:                  # vLLM connects to the bridge's host; the bridge binds
            vllm_ep, bridge_ep = f"tcp://127.0.0.1:{pub_port}", f"tcp://*:{pub_port}"
        self.vllm_ep = vllm_ep
        self.replay_ep = f"tcp://*:{replay_port}" if replay else None
        self.form, self.buffer_steps = form, buffer_steps
        self.pub = self.new_publisher()
        self.engine = FakeVllmEngine(BS, num_blocks, self.pub)
        cfg = dict(manager=f"127.0.0.1:{mgr.port}", insecure=True, ttl_ms=1500,
                   engine_timeout_s=1.5, probe_interval_s=0.2, replay_timeout_s=0.5)
        cfg.update(cfg_kw)
        self.cfg = BridgeConfig(
            namespace=NamespaceConfig(tenant=TENANT, model=MODEL, preset="llama-3-8b",
                                      page_size=page_size),
            engines=[EngineConfig(id=engine_id, endpoint=bridge_ep, endpoint_mode=mode,
                                  replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
                                  if replay else "", token=token, block_size=BS)],
            **cfg)
        self.bridge = Bridge(self.cfg)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.bridge.run(self.stop))

    def new_publisher(self):
        return FakeVllmPublisher(self.vllm_ep, self.replay_ep, buffer_steps=self.buffer_steps,
                                 form=self.form)

    @property
    def eb(self):
        return self.bridge.engines[0]

    def hashes(self, tokens, **kw):
        return hash_request(self.mgr.key(TENANT, MODEL), tokens,
                            self.cfg.namespace.page_size or BS, BS, **kw)

    def expected(self):
        """Pages the engine holds with all their ancestors (prefix-closed), as kvcm hashes."""
        cached, out = self.engine.cached_digests(), set()
        k = (self.cfg.namespace.page_size or BS) // BS
        for d in cached:
            path, x = [], d
            while x is not None:
                path.append(x)
                x = self.engine.meta[x][0]
            if len(path) % k == 0 and all(p in cached for p in path):
                path.reverse()
                toks = [t for p in path for t in self.engine.meta[p][1]]
                out.add(self.hashes(toks, block_extras=[self.engine.meta[p][2]
                                                        for p in path])[-1])
        return out

    async def converge(self, timeout=8.0, want=None):
        deadline = time.monotonic() + timeout
        while True:
            target = self.expected() if want is None else want
            if self.mgr.pages(self.engine_id) == target:
                return target
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"manager has {len(self.mgr.pages(self.engine_id))} pages, engine "
                    f"{len(target)}; stream {self.eb.stream.counters}, session "
                    f"{self.eb.session.counters}")
            await asyncio.sleep(0.05)

    async def close(self):
        self.stop.set()
        await asyncio.wait_for(self.task, 10)
        self.pub.shutdown()


@pytest_asyncio.fixture
async def mgr():
    m = FakeEngineManager(secret=bytes(range(16)))
    await m.start()
    yield m
    await m.stop()


async def run_prompts(rig, seeds, **kw):
    for s in seeds:
        rig.engine.process(prompt(s), **kw)
    rig.pub.flush()


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["legacy", "array", "map"])
@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_engine_cache_reaches_the_manager(mgr, form, mode):
    rig = Rig(mgr, form=form, mode=mode)
    try:
        await run_prompts(rig, range(3))  # before the bridge subscribed: replayed
        await rig.converge()
        await run_prompts(rig, range(3, 8))
        got = await rig.converge()
        assert rig.hashes(prompt(5))[0] in got
        assert mgr.match(rig.engine_id, rig.hashes(prompt(5))) == 5
        assert rig.eb.stream.counters.resyncs == 0
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_eviction_and_pages_of_several_blocks(mgr):
    rig = Rig(mgr, num_blocks=20, page_size=2 * BS)
    try:
        await run_prompts(rig, range(12))  # 6 blocks each: evictions
        got = await rig.converge()
        assert got and rig.eb.mirror.counters.blocks_removed > 0
        assert mgr.match(rig.engine_id, rig.hashes(prompt(11))) == 2  # 5 blocks: 2 pages
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_lost_message_is_replayed(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, [0])
        await rig.converge()
        rig.pub.drop_live(2)
        await run_prompts(rig, [1, 2, 3])
        await rig.converge()
        c = rig.eb.stream.counters
        assert c.gaps == 1 and c.resyncs == 0 and c.lost_batches == 0
        # A lost last message has no successor to reveal the gap: the probe finds it.
        rig.pub.drop_live(1)
        await run_prompts(rig, [4])
        await rig.converge()
        assert rig.eb.stream.counters.probes > 0
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_gap_beyond_the_buffer_resyncs(mgr):
    rig = Rig(mgr, buffer_steps=3)
    try:
        await run_prompts(rig, [0])
        await rig.converge()
        rig.pub.drop_live(5)
        await run_prompts(rig, range(1, 7))
        # Rebuilt from what the engine still buffers: the last 3 batches. The rest of its
        # cache stays unknown to kvcm (fewer hits, never a wrong one).
        await rig.converge(want={h for s in (4, 5, 6) for h in rig.hashes(prompt(s))})
        assert rig.eb.stream.counters.resyncs == 1
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_garbage_batch_resyncs(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, [0])
        await rig.converge()
        rig.pub.publish_payload(b"\xc1 garbage")
        rig.pub.publish_payload(msgspec.msgpack.encode([1.0, [["NoSuchEvent"]]]))
        await run_prompts(rig, [1])
        await rig.converge()
        c = rig.eb.stream.counters
        assert c.bad_payloads >= 2 and c.resyncs == 1
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_all_blocks_cleared_empties_the_pool(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, range(3))
        assert await rig.converge()
        rig.engine.clear()
        rig.pub.flush()
        await rig.converge(want=set())
        await run_prompts(rig, [9])
        assert len(await rig.converge()) == 5
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_dead_engine_is_dropped_and_comes_back(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, range(2))
        await rig.converge()
        rig.pub.shutdown()
        t0 = time.monotonic()
        await rig.converge(want=set(), timeout=5)
        assert time.monotonic() - t0 < 1.5 + 1.0
        assert rig.engine_id not in mgr.sessions  # closed, not just emptied
        # It restarts (empty cache, seq from 0) on the same endpoints.
        rig.pub = rig.new_publisher()
        rig.engine = FakeVllmEngine(BS, 256, rig.pub)
        await run_prompts(rig, [5])
        assert len(await rig.converge()) == 5
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_restarted_publisher_is_resynced(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, range(3))
        await rig.converge()
        rig.pub.shutdown()
        rig.pub = rig.new_publisher()  # restarted before the bridge noticed it was gone
        rig.engine = FakeVllmEngine(BS, 256, rig.pub)
        await run_prompts(rig, [7])
        assert len(await rig.converge()) == 5
        assert rig.eb.stream.counters.restarts >= 1
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_manager_restart_is_followed_by_a_resync(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, range(3))
        want = await rig.converge()
        sessions = rig.eb.session.counters.sessions
        mgr.restart()
        assert mgr.pages(rig.engine_id) == set()
        await rig.converge(want=want)  # the next heartbeat learns it, a new session resends
        assert rig.eb.session.counters.sessions == sessions + 1
        assert rig.eb.session.counters.errors["FAILED_PRECONDITION"] >= 1
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_wrong_token_stores_nothing(mgr):
    mgr.tokens = {"good-token-0123456789": ("vllm-0", TENANT),
                  "other-engine-0123456789": ("vllm-1", TENANT)}
    rig = Rig(mgr, token="other-engine-0123456789")
    try:
        await run_prompts(rig, range(2))
        await asyncio.sleep(1.0)
        assert mgr.pages("vllm-0") == set() and "vllm-0" not in mgr.sessions
        assert rig.eb.session.counters.errors.get("PERMISSION_DENIED", 0) >= 1
        assert not rig.task.done()  # still running, retrying slowly
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_salts_stay_apart_end_to_end(mgr):
    rig = Rig(mgr)
    try:
        p = prompt(3)
        rig.engine.process(p, cache_salt="alice")
        rig.pub.flush()
        await rig.converge()
        assert mgr.match(rig.engine_id, rig.hashes(p, cache_salt="alice")) == 5
        assert mgr.match(rig.engine_id, rig.hashes(p)) == 0
        assert mgr.match(rig.engine_id, rig.hashes(p, cache_salt="bob")) == 0
        assert mgr.match(rig.engine_id, rig.hashes(p, lora_name="x")) == 0
        assert mgr.match(rig.engine_id, rig.hashes(p, lora_name="x", cache_salt="alice")) == 0
    finally:
        await rig.close()


@pytest.mark.asyncio
async def test_metrics(mgr):
    rig = Rig(mgr)
    try:
        await run_prompts(rig, range(2))
        await rig.converge()
        await asyncio.sleep(1.2)  # the loop's snapshot
        text = generate_latest(registry_for(rig.bridge.engines)).decode()
        assert 'kvcm_vllm_bridge_batches_total{engine="vllm-0"} 2.0' in text
        assert 'kvcm_vllm_bridge_events_total{engine="vllm-0",type="BlockStored"} 2.0' in text
        assert 'kvcm_vllm_bridge_visible_pages{engine="vllm-0",tier="GPU"} 10.0' in text
        assert 'kvcm_vllm_bridge_up{engine="vllm-0"} 1.0' in text
    finally:
        await rig.close()
