"""kvcm-bridge in bind mode against publishers that are not the engine (issue 35): a
kvcm-bridge process and a kvcm-manager process on loopback, a fake vLLM engine publishing to
the bridge, and attackers publishing to the same endpoint without credentials.

- a foreign publisher's batches (a prompt, AllBlocksCleared, sequence numbers that would be a
  restart or a gap) are refused: the engine's pages stay in its pool, nothing is injected,
  no resync runs, and the bridge keeps mirroring the engine;
- a frame over max_frame_bytes is dropped by ZMQ before it is allocated (the bridge's peak RSS
  stays far below it) and the bridge keeps working;
- a bind endpoint beyond loopback without CURVE is refused at start;
- with CURVE, a publisher without a listed key (none, or another) cannot inject anything.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import zmq  # noqa: E402
import zmq.auth  # noqa: E402

from conftest import Process, binary, free_port  # noqa: E402
from kvcm import hashing  # noqa: E402
from kvcm.engines.pagehash import hash_request  # noqa: E402
from kvcm.testing.fake_vllm import FakeVllmEngine, FakeVllmPublisher  # noqa: E402
from rigs.bridge import RealManagerView  # noqa: E402
from rigs.manager import ManagerProcess  # noqa: E402

BS = 16
MIB = 1 << 20
SECRET = bytes(range(16))
TENANT, MODEL, ENGINE_ID = "acme", "llama-3-8b", "vllm-0"
ENGINE = "engine-token-vllm-0-0123456789"
ADMIN = "admin-token-ops-0123456789ab"
TOKENS = {ENGINE: "vllm-0 roles=engine engine=vllm-0 tenant=acme", ADMIN: "ops roles=admin"}


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


class BridgeProcess(Process):
    def __init__(self, tmp: Path, manager: str, endpoint: str, replay: str,
                 extra_engine: str = "") -> None:
        self.metrics_port = free_port()
        self.config = tmp / "bridge.toml"
        self.config.write_text(f"""
manager_address = "{manager}"
insecure = true
metrics_address = "127.0.0.1:{self.metrics_port}"
engine_timeout_s = 5
probe_interval_s = 0.5
replay_timeout_s = 1
ttl_ms = 3000

[namespace]
tenant = "{TENANT}"
model = "{MODEL}"
preset = "llama-3-8b"

[[engine]]
id = "{ENGINE_ID}"
endpoint = "{endpoint}"
endpoint_mode = "bind"
replay_endpoint = "{replay}"
token = "{ENGINE}"
block_size = {BS}
{extra_engine}
""")
        super().__init__([sys.executable, "-m", "kvcm.engines.bridge", "--config",
                          str(self.config)], tmp / "bridge.log")

    def metric(self, name: str) -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return -1.0
        for line in text.splitlines():
            if line.startswith(f"kvcm_vllm_bridge_{name}{{") and f'engine="{ENGINE_ID}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
def manager(tmp_path):
    proc = ManagerProcess(binary("KVCM_MANAGER_BIN", "kvcm-manager"), tmp_path / "manager",
                          secret=SECRET, tokens=TOKENS)
    proc.start()
    yield proc
    proc.kill()


async def until(predicate, what: str, timeout_s: float = 15.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


class Engine:
    """The real engine: a fake vLLM publishing to the bridge's endpoint."""

    def __init__(self, endpoint: str, replay_port: int, curve=None) -> None:
        self.pub = FakeVllmPublisher(endpoint, f"tcp://127.0.0.1:{replay_port}", curve=curve)
        self.engine = FakeVllmEngine(BS, 256, self.pub)
        self.key = hashing.namespace_key(SECRET, TENANT, MODEL)

    def run(self, seed: int) -> list[bytes]:
        tokens = prompt(seed)
        self.engine.process(tokens)
        self.pub.flush()
        return hash_request(self.key, tokens, BS, BS)


async def held(view: RealManagerView, hashes: list[bytes]) -> int:
    """Leading pages of `hashes` in the engine's pool (0 before the namespace exists)."""
    try:
        return await view.engine_prefix(TENANT, MODEL, BS, ENGINE_ID, hashes)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return 0


def attacker(endpoint: str, curve=None) -> tuple[FakeVllmPublisher, FakeVllmEngine]:
    pub = FakeVllmPublisher(endpoint, None, curve=curve)
    return pub, FakeVllmEngine(BS, 256, pub)


async def attack(pub: FakeVllmPublisher, eng: FakeVllmEngine, seconds: float,
                 bridge: BridgeProcess | None = None) -> None:
    """Injects a prompt and clears, with sequence numbers from 0 (a restart to the bridge)
    and then far ahead (a gap), for `seconds` (until the bridge counted some, if given)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        eng.process(prompt(666))
        eng.clear()
        pub.flush()
        await asyncio.sleep(0.1)
        if bridge is not None and bridge.metric("foreign_batches_total") >= 4:
            break
    pub._seq = itertools.count(10**6)  # a gap
    for _ in range(3):
        eng.process(prompt(667))
        eng.clear()
    pub.flush()
    await asyncio.sleep(0.5)


@pytest.mark.asyncio
async def test_a_foreign_publisher_is_refused_and_a_huge_frame_dropped(tmp_path, manager):
    view = RealManagerView(manager, ADMIN)
    port, replay = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    bridge = BridgeProcess(tmp_path, manager.address, endpoint, f"tcp://127.0.0.1:{replay}")
    engine = Engine(endpoint, replay)
    atk_pub, atk = attacker(endpoint)
    try:
        a = engine.run(1)
        await until(lambda: held(view, a), "the engine's pages", 30)
        assert await held(view, a) == 5
        pages = await view.pool_pages(ENGINE_ID)
        resyncs = bridge.metric("resyncs_total")
        await attack(atk_pub, atk, 10.0, bridge)
        assert bridge.metric("foreign_batches_total") >= 4, bridge.log.read_text()[-3000:]
        # Nothing the attacker sent changed anything.
        assert await held(view, a) == 5
        assert await view.pool_pages(ENGINE_ID) == pages
        assert await held(view, hash_request(engine.key, prompt(666), BS, BS)) == 0
        assert await held(view, hash_request(engine.key, prompt(667), BS, BS)) == 0
        assert bridge.metric("resyncs_total") == resyncs
        # The engine is still mirrored.
        c = engine.run(2)
        await until(lambda: held(view, c), "the engine's next pages")
        # The replay confirmed the engine's connection (its live batches apply again).
        await until(lambda: "publisher connection taken" in bridge.log.read_text(),
                    "the engine's connection confirmed")
        # A 128 MiB frame (cap 16 MiB): dropped, with the attacker's connection.
        base = bridge.status("VmRSS")
        atk_pub.publish_payload(b"x" * (128 * MIB))
        atk_pub.flush(30)
        await asyncio.sleep(1.0)
        assert bridge.proc.poll() is None
        assert bridge.status("VmHWM") - base < 32 * MIB, (base, bridge.status("VmHWM"))
        d = engine.run(3)
        await until(lambda: held(view, d), "pages after the huge frame")
        assert await held(view, a) == 5
    finally:
        atk_pub.shutdown()
        engine.pub.shutdown()
        bridge.stop()
        await view.close()


@pytest.mark.parametrize("endpoint", ["tcp://*:{}", "tcp://0.0.0.0:{}"])
def test_bind_beyond_loopback_without_curve_is_refused_at_start(tmp_path, endpoint):
    bridge = BridgeProcess(tmp_path, "127.0.0.1:1", endpoint.format(free_port()),
                           f"tcp://127.0.0.1:{free_port()}")
    try:
        assert bridge.proc.wait(30) == 2
    finally:
        bridge.stop()
    log = bridge.log.read_text()
    assert "bind a loopback address" in log and "curve_secret_key_file" in log


@pytest.mark.asyncio
async def test_with_curve_a_publisher_without_the_key_cannot_inject(tmp_path, manager):
    keys, pubs, others = tmp_path / "bridge-keys", tmp_path / "publishers", tmp_path / "other"
    for d in (keys, pubs, others):
        d.mkdir()
    _, bridge_secret_file = zmq.auth.create_certificates(str(keys), "bridge")
    server_public, _ = zmq.auth.load_certificate(bridge_secret_file)
    _, engine_secret_file = zmq.auth.create_certificates(str(pubs), "vllm-0")
    engine_public, engine_secret = zmq.auth.load_certificate(engine_secret_file)
    os.remove(engine_secret_file)  # the bridge's directory holds public certificates only
    _, other_secret_file = zmq.auth.create_certificates(str(others), "intruder")
    other_public, other_secret = zmq.auth.load_certificate(other_secret_file)

    view = RealManagerView(manager, ADMIN)
    port, replay = free_port(), free_port()
    bridge = BridgeProcess(
        tmp_path, manager.address, f"tcp://*:{port}", f"tcp://127.0.0.1:{replay}",
        f'curve_secret_key_file = "{bridge_secret_file}"\n'
        f'curve_publisher_keys_dir = "{pubs}"\n')
    endpoint = f"tcp://127.0.0.1:{port}"
    engine = Engine(endpoint, replay, curve=(server_public, engine_public, engine_secret))
    plain_pub, plain = attacker(endpoint)
    wrong_pub, wrong = attacker(endpoint, curve=(server_public, other_public, other_secret))
    try:
        a = engine.run(1)
        await until(lambda: held(view, a), "the engine's pages over CURVE", 30)
        assert await held(view, a) == 5
        pages = await view.pool_pages(ENGINE_ID)
        await asyncio.gather(attack(plain_pub, plain, 2.0), attack(wrong_pub, wrong, 2.0))
        assert await held(view, a) == 5
        assert await view.pool_pages(ENGINE_ID) == pages
        assert await held(view, hash_request(engine.key, prompt(666), BS, BS)) == 0
        assert bridge.metric("foreign_batches_total") == 0  # none got through ZMQ at all
        c = engine.run(2)
        await until(lambda: held(view, c), "the engine's next pages")
        assert "CURVE key" in bridge.log.read_text()
    finally:
        for p in (plain_pub, wrong_pub, engine.pub):
            p.shutdown()
        bridge.stop()
        await view.close()
