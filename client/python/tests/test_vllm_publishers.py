"""The bridge against the frames of vLLM's own ZmqEventPublisher, release by release.

tests/data/vllm_publishers/<version>.json holds what each release's unmodified publisher sent
for `rigs.vllm_publishers.script` (made by that module from the release's wheel).
Each test serves those exact frames (live, and replay in the release's form) over loopback
ZMQ to a bridge publishing into a real kvcm-manager, then checks with probe Matches that the
manager holds exactly the pages the events say the engine holds. Where the wheel cache
($KVCM_VLLM_WHEELS, as `vllm_publishers --cache`) has a release's kv_events.py, the release's
real publisher also runs live. fake_vllm's frames are checked against the goldens.
"""

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvcm import hashing
from kvcm.testing.fake_vllm import FakeVllmPublisher
from kvcm.engines.bridge import Bridge
from kvcm.engines.config import BridgeConfig, EngineConfig, NamespaceConfig
from kvcm.vllm.events import decode_batch
from kvcm.engines.pagehash import hash_request
from kvcm.engines.wire import END_SEQ
from rigs.bridge import RealManagerView
from rigs.manager import ManagerProcess, free_port
from rigs.vllm_publishers import (BLOCK_SIZE, KV_EVENTS, RELEASES, TOPIC, RealPublisherThread,
                                  frames_of)

DATA = Path(__file__).parent / "data" / "vllm_publishers"
SECRET = bytes(range(16))
ENGINE = "engine-token-vllm-0-0123456789"
ADMIN = "admin-token-ops-0123456789ab"
TOKENS = {ENGINE: "vllm-0 roles=engine engine=vllm-0 tenant=acme", ADMIN: "ops roles=admin"}
TENANT, MODEL = "acme", "llama-3-8b"


def golden(version):
    return json.loads((DATA / f"{version}.json").read_text())


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    binary = os.environ.get("KVCM_MANAGER_BIN")
    if not binary:
        if os.environ.get("KVCM_REQUIRE_PYTHON") == "1":
            pytest.fail("KVCM_MANAGER_BIN is not set (KVCM_REQUIRE_PYTHON=1)")
        pytest.skip("KVCM_MANAGER_BIN is not set")
    proc = ManagerProcess(binary, tmp_path_factory.mktemp("manager"), secret=SECRET,
                          tokens=TOKENS)
    proc.start()
    yield proc
    proc.kill()


class GoldenPublisher:
    """Serves a golden capture: its live messages on a PUB socket, its recorded replay
    answers (of the batches published so far) on a ROUTER, byte for byte."""

    def __init__(self, data, pub_port, replay_port):
        self.live = frames_of(data["live"])
        self.answers = frames_of(data["replay"]["0"])  # every batch, then the end marker
        self.published = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind(f"tcp://127.0.0.1:{replay_port}")
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, n):
        with self._lock:
            for m in self.live[self.published:self.published + n]:
                self._pub.send_multipart(m)
            self.published += n

    def _serve(self):
        while self._running:
            if not self._router.poll(50):
                continue
            ident, _, start = self._router.recv_multipart()
            start = int.from_bytes(start, "big")
            with self._lock:
                for m in self.answers:
                    seq_frame = m[-2]
                    if seq_frame == END_SEQ:
                        self._router.send_multipart([ident] + m)
                        break
                    seq = int.from_bytes(seq_frame, "big")
                    if start <= seq < self.published:
                        self._router.send_multipart([ident] + m)

    def shutdown(self):
        self._running = False
        self._thread.join(2)
        self._ctx.destroy(linger=0)


def bridge_for(manager, pub_port, replay_port):
    cfg = BridgeConfig(
        manager_address=manager.address, insecure=True, ttl_ms=3000, engine_timeout_s=3.0,
        probe_interval_s=0.3, replay_timeout_s=1.0,
        namespace=NamespaceConfig(tenant=TENANT, model=MODEL, preset="llama-3-8b"),
        engines=[EngineConfig(id="vllm-0", endpoint=f"tcp://127.0.0.1:{pub_port}",
                              replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                              topic=TOPIC, token=ENGINE, block_size=BLOCK_SIZE)])
    return Bridge(cfg)


async def until(cond, timeout=8.0, what=""):
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        await asyncio.sleep(0.05)


async def run_release(manager, expect, publish_first, publish_rest, total, name):
    """Bridge up after `publish_first()` (replayed), then `publish_rest()` live; checks the
    manager's Matches against `expect`."""
    pub_port, replay_port = free_port(), free_port()
    view = RealManagerView(manager, ADMIN)
    key = hashing.namespace_key(SECRET, TENANT, MODEL)
    publisher = publish_first(pub_port, replay_port)
    bridge = bridge_for(manager, pub_port, replay_port)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    eb = bridge.engines[0]
    try:
        async def synced():
            return eb.stream.up and eb.mirror is not None
        await until(synced, what=f"{name}: first sync")
        publish_rest(publisher)

        async def all_applied():
            return eb.stream.next_seq == total
        await until(all_applied, what=f"{name}: batches applied ({eb.stream.counters})")

        async def matches():
            got = []
            for e in expect:
                hashes = hash_request(key, e["tokens"], BLOCK_SIZE, BLOCK_SIZE,
                                      cache_salt=e.get("cache_salt"),
                                      lora_name=e.get("lora_name"))
                got.append(await view.engine_prefix(TENANT, MODEL, BLOCK_SIZE, "vllm-0",
                                                    hashes))
            want_pool = len({h for e in expect for h in hash_request(
                key, e["tokens"][:BLOCK_SIZE * e["pages"]], BLOCK_SIZE, BLOCK_SIZE,
                cache_salt=e.get("cache_salt"))})
            matches.last = (got, await view.pool_pages("vllm-0"))
            return matches.last == ([e["pages"] for e in expect], want_pool)
        try:
            await until(matches, what=name)
        except AssertionError:
            raise AssertionError(f"{name}: Match, pool pages {matches.last}; want "
                                 f"{[e['pages'] for e in expect]}") from None
        s, m = eb.stream.counters, eb.mirror.counters
        assert s.resyncs == 0 and s.bad_payloads == 0 and eb.bad_frames == 0, s
        assert m.restored_blocks == 2 and m.refused_blocks["lora"] == 1
        return eb
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        publisher.shutdown()
        await view.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("version", RELEASES)
async def test_golden_frames_mirror_exactly(manager, version):
    data = golden(version)
    total = len(data["live"])
    half = total // 2

    def first(pub_port, replay_port):
        g = GoldenPublisher(data, pub_port, replay_port)
        with g._lock:
            g.published = half  # published before the bridge subscribed: only replayed
        return g

    eb = await run_release(manager, data["expect"], first, lambda g: g.publish(total - half),
                           total, version)
    old = tuple(int(x) for x in version.split(".")) < (0, 26)
    assert eb.replay_form == ("seq" if old else "topic")


def _wheel_source(version):
    cache = os.environ.get("KVCM_VLLM_WHEELS")
    src = Path(cache) / "src" / version / KV_EVENTS if cache else None
    if src is None or not src.exists():
        if os.environ.get("KVCM_REQUIRE_VLLM") == "1":
            pytest.fail(f"no kv_events.py of vLLM {version} in $KVCM_VLLM_WHEELS "
                        "(KVCM_REQUIRE_VLLM=1; scripts/test.sh fetches them)")
        pytest.skip(f"no kv_events.py of vLLM {version} in $KVCM_VLLM_WHEELS")
    return src


@pytest.mark.asyncio
@pytest.mark.parametrize("version", RELEASES)
async def test_real_publisher_live(manager, version):
    src = _wheel_source(version)
    holder = {}

    def first(pub_port, replay_port):
        p = RealPublisherThread(version, src, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
        holder["p"] = p
        half = len(p.batches) // 2
        for b in p.batches[:half]:
            p.publish(b)
        holder["half"] = half
        return p

    def rest(p):
        for b in p.batches[holder["half"]:]:
            p.publish(b)

    data = golden(version)
    await run_release(manager, data["expect"], first, rest, len(data["live"]),
                      f"{version} live")


def _layout(msg):
    """A message's frame structure with the payload's field layout (names or positions)
    and value types, without the values."""
    def shape(v):
        if isinstance(v, dict):
            return {k: shape(x) for k, x in sorted(v.items()) if k != "ts"}
        if isinstance(v, list):
            return [shape(x) for x in v[:1]] if v and not isinstance(v[0], str) else (
                [v[0]] + [type(x).__name__ for x in v[1:]] if v else [])
        return type(v).__name__
    frames = [f if len(f) != 8 else b"<seq>" for f in msg[:-1]]
    batch = msgspec.msgpack.decode(msg[-1]) if msg[-1] else None
    if isinstance(batch, list):
        batch = [type(batch[0]).__name__, [shape(e) for e in batch[1][:1]]] + batch[2:]
    return frames, batch


@pytest.mark.parametrize("version", RELEASES)
def test_fake_vllm_speaks_each_release_wire(version):
    """fake_vllm, set to a release, sends the frame structure and field layout of that
    release's real publisher (the first batch: a two-block BlockStored)."""
    data = golden(version)
    real_live = frames_of(data["live"])[0]
    real_replay = frames_of(data["replay"]["0"])
    pub_port, replay_port = free_port(), free_port()
    pub = FakeVllmPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", topic=TOPIC,
                            release=version)
    ctx = zmq.Context()
    try:
        first = decode_batch(real_live[2]).events
        pub.publish(first)
        pub.flush()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while not got or END_SEQ not in got[-1]:
            assert dealer.poll(5000)
            got.append(dealer.recv_multipart())
        assert _layout(got[0]) == _layout(real_replay[0])
        assert _layout(got[-1]) == _layout(real_replay[-1])
        assert [len(m) for m in got] == [len(real_replay[0]), len(real_replay[-1])]
        assert _layout([TOPIC.encode()] + got[0][-2:]) == _layout(real_live)
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)
