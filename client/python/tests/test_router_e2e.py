"""End to end: kvcm-manager + kvcm-vllm-bridge + kvcm-router (kv-aware) + two fake engines
publishing vLLM KV events. Requests must follow the engine that holds their prefix (as the
engines' own cached_tokens and metrics show), spread when one prefix is hot, never match
another salt's pages, stream, and avoid an engine that went down."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("kvcm.testing.fake_vllm")
pytest.importorskip("kvcm.engines.bridge")

import aiohttp  # noqa: E402
import pytest_asyncio  # noqa: E402

import kvcm  # noqa: E402
from conftest import free_port  # noqa: E402
from kvcm.router.tokenizer import WordTokenizer  # noqa: E402
from kvcm.engines import hash_request  # noqa: E402
from kvcm.engines.bridge import Bridge  # noqa: E402
from kvcm.engines.config import BridgeConfig, EngineConfig  # noqa: E402
from kvcm.engines.config import NamespaceConfig as BridgeNamespace  # noqa: E402
from rigs.router import metrics_text, post, sample, sse, start_engine, start_router  # noqa: E402

TENANT, MODEL, BLOCK = "acme", "fake-model", 16
NS = kvcm.Namespace(TENANT, MODEL)


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


class Cluster:
    """Two fake engines (e0, e1), a bridge mirroring both, a kv-aware router."""

    def __init__(self, manager_address: str, *, tokens: Optional[Dict[str, str]] = None,
                 workdir: Optional[Path] = None) -> None:
        """`tokens`: role -> bearer token ("router", "worker", "e0", "e1", "admin") for a
        manager with a tokens file; the worker's registers for the bridge and the router."""
        self.manager_address = manager_address
        self.tokens = tokens or {}
        self.workdir = workdir
        self.engines: Dict[str, Any] = {}
        self.served: Dict[str, Any] = {}

    def _token_file(self, role: str) -> str:
        if role not in self.tokens:
            return ""
        assert self.workdir is not None
        path = self.workdir / f"{role}.token"
        path.write_text(self.tokens[role] + "\n")
        return str(path)

    async def start(self, router_kw: Optional[Dict[str, Any]] = None,
                    **engine_kw: Any) -> "Cluster":
        bridge_engines = []
        for engine_id in ("e0", "e1"):
            pub, replay = free_port(), free_port()
            engine, served = await start_engine(
                engine_id, model=MODEL, block_size=BLOCK, num_blocks=256,
                kv_events_endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}",
                lora_adapters=("sql-lora",), **engine_kw)
            self.engines[engine_id], self.served[engine_id] = engine, served
            bridge_engines.append(EngineConfig(
                id=engine_id, endpoint=f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}", block_size=BLOCK,
                token=self.tokens.get(engine_id, "")))
        self.bridge_cfg = BridgeConfig(
            manager_address=self.manager_address, insecure=True, ttl_ms=5000, engine_timeout_s=3.0,
            register_token_file=self._token_file("worker"),
            probe_interval_s=0.3, replay_timeout_s=0.5,
            namespace=BridgeNamespace(tenant=TENANT, model=MODEL, preset="llama-3-8b",
                                      page_size_tokens=BLOCK),
            engines=bridge_engines)
        self.bridge = Bridge(self.bridge_cfg)
        self.stop_bridge = asyncio.Event()
        self.bridge_task = asyncio.create_task(self.bridge.run(self.stop_bridge))
        self.router, self.router_served = await start_router(
            [(e, self.served[e].url) for e in ("e0", "e1")], "kv-aware",
            manager_address=self.manager_address, insecure=True, route_deadline_ms=2000,
            lora_adapters=["sql-lora"], prefill_tokens_per_s=1000.0,
            token_file=self._token_file("router"), **(router_kw or {}))
        self.url = self.router_served.url
        self.client = kvcm.aio.Client(self.manager_address, insecure=True,
                                      token=self.tokens.get("admin"))
        await self.client.register_model(NS, kvcm.ModelSpec.llama3_8b(page_size_tokens=BLOCK))
        self.key = self.client._cached_key(NS).key
        await self.wait_sessions({"e0", "e1"})
        return self

    async def wait_sessions(self, engines: set) -> None:
        """Until the bridge has a live session for each engine (as a deployment starts)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while not engines <= {e.engine_id for e in (await self.client.stats()).engines}:
            if loop.time() > end:
                raise AssertionError(f"no live bridge session for some of {engines}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.router_served.stop()
        self.stop_bridge.set()
        await asyncio.wait_for(self.bridge_task, 10)
        for served in self.served.values():
            await served.stop()
        await self.client.close()

    async def held_pages(self, engine_id: str, text: str, **extra: Any) -> int:
        """Leading pages of `text`'s prompt the manager says `engine_id` holds."""
        tokens = WordTokenizer().encode(text)
        hashes = hash_request(self.key, tokens, BLOCK, BLOCK, **extra)
        try:
            result = await self.client.route(NS, page_hashes=hashes, candidates=[engine_id],
                                             probe=True)
        except kvcm.NotFound:  # no live session for the engine yet
            return 0
        return result.ranked[0].cached_pages

    async def wait_held(self, engine_id: str, text: str, pages: int, **extra: Any) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while (held := await self.held_pages(engine_id, text, **extra)) < pages:
            if loop.time() > end:
                raise AssertionError(f"manager shows {held} of {pages} pages on {engine_id}")
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture
async def cluster(manager):
    c = await Cluster(manager.address).start()
    yield c
    await c.close()


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, **extra: Any
                   ) -> Tuple[int, Dict[str, Any], str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra}
    return await post(http, url + "/v1/completions", body)


def cached(answer: Dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.asyncio
async def test_requests_follow_the_engine_that_holds_their_prefix(cluster):
    prefix = words("sys", 64)  # 4 blocks
    async with aiohttp.ClientSession() as http:
        status, first, holder = await complete(http, cluster.url, prefix + " " + words("a", 5))
        assert status == 200 and cached(first) == 0
        await cluster.wait_held(holder, prefix, 4)
        other = "e1" if holder == "e0" else "e0"
        engines: List[str] = []
        for i in range(6):
            status, answer, engine = await complete(http, cluster.url,
                                                    prefix + " " + words(f"q{i}_", 7))
            assert status == 200
            engines.append(engine)
            assert cached(answer) == 64
        assert engines == [holder] * 6
        text = await metrics_text(http, cluster.url)
    assert sample(text, "kvcm_router_expected_cached_tokens_total", {"engine": holder}) == 6 * 64
    assert sample(text, "kvcm_router_engine_cached_tokens_total", {"engine": holder}) == 6 * 64
    assert sample(text, "kvcm_router_decisions_total",
                  {"policy": "kv-aware", "reason": "fallback"}) == 0
    assert cluster.engines[holder].hits == 6 * 64
    assert cluster.engines[other].hits == 0


@pytest.mark.asyncio
async def test_a_hot_prefix_spreads_once_in_flight_builds(manager):
    c = await Cluster(manager.address).start(decode_ms_per_token=100)
    try:
        prefix = words("hot", 64)
        async with aiohttp.ClientSession() as http:
            _, _, holder = await complete(http, c.url, prefix + " warm")
            await c.wait_held(holder, prefix, 4)
            results = await asyncio.gather(*[
                complete(http, c.url, prefix + " " + words(f"u{i}_", 5)) for i in range(16)])
            text = await metrics_text(http, c.url)
        counts = {e: sum(1 for r in results if r[2] == e) for e in ("e0", "e1")}
        assert all(r[0] == 200 for r in results)
        other = "e1" if holder == "e0" else "e0"
        # Affinity first, but the guard (in_flight <= 2 * least + 4) caps the holder.
        assert counts[holder] >= 8 and counts[other] >= 3, counts
        assert counts[holder] <= 2 * counts[other] + 5, counts
        assert sample(text, "kvcm_router_decisions_total",
                      {"policy": "kv-aware", "reason": "imbalance-guard"}) >= 1
    finally:
        await c.close()


@pytest.mark.asyncio
async def test_salted_and_lora_requests_never_match_other_keys(cluster):
    prefix = words("doc", 48)  # 3 blocks
    async with aiohttp.ClientSession() as http:
        _, first, holder = await complete(http, cluster.url, prefix + " x", cache_salt="alice")
        await cluster.wait_held(holder, prefix, 3, cache_salt="alice")
        assert await cluster.held_pages(holder, prefix) == 0  # unsalted: other pages
        assert await cluster.held_pages(holder, prefix, cache_salt="bob") == 0

        async def expected(engine: str) -> float:
            return sample(await metrics_text(http, cluster.url),
                          "kvcm_router_expected_cached_tokens_total", {"engine": engine})

        before = {e: await expected(e) for e in ("e0", "e1")}
        _, bob, _ = await complete(http, cluster.url, prefix + " y", cache_salt="bob")
        _, plain, _ = await complete(http, cluster.url, prefix + " z")
        _, lora, _ = await complete(http, cluster.url, prefix + " w", model="sql-lora")
        assert (cached(bob), cached(plain), cached(lora)) == (0, 0, 0)
        assert {e: await expected(e) for e in ("e0", "e1")} == before
        status, again, engine = await complete(http, cluster.url, prefix + " v",
                                               cache_salt="alice")
        assert (status, engine, cached(again)) == (200, holder, 48)
        assert await expected(holder) == before[holder] + 48


@pytest.mark.asyncio
async def test_with_tokens_the_router_probes_with_its_role_and_reads_the_key(
        manager_factory, workdir):
    """A manager with a tokens file: the router's token probes, and reads the key of the
    namespace the bridge registered (a router may not create it); a worker token for
    RegisterModel changes nothing then. Salted requests are ranked either way."""
    import hashlib

    tokens = {"router": "router-token-0123456789", "worker": "worker-token-0123456789",
              "e0": "engine0-token-0123456789", "e1": "engine1-token-0123456789",
              "admin": "admin-token-0123456789"}
    lines = {"router": f"router roles=router tenants={TENANT}",
             "worker": f"worker roles=worker tenant={TENANT}",
             "e0": f"e0 roles=engine engine=e0 tenant={TENANT}",
             "e1": f"e1 roles=engine engine=e1 tenant={TENANT}", "admin": "ops roles=admin"}
    table = workdir / "tokens"
    table.write_text("".join(f"{hashlib.sha256(tokens[r].encode()).hexdigest()} {lines[r]}\n"
                             for r in tokens))
    m = manager_factory(f"--tokens_file={table}").start()
    prefix = words("auth", 48)
    for register in (True, False):
        kw = {"register_token_file": str(workdir / "worker.token")} if register else {}
        c = await Cluster(m.address, tokens=tokens, workdir=workdir).start(router_kw=kw)
        try:
            async with aiohttp.ClientSession() as http:
                salt = f"s{register}"
                _, _, holder = await complete(http, c.url, prefix + " a", cache_salt=salt)
                await c.wait_held(holder, prefix, 3, cache_salt=salt)
                _, plain_first, plain_holder = await complete(http, c.url, prefix + " b")
                await c.wait_held(plain_holder, prefix, 3)
                status, salted, engine = await complete(http, c.url, prefix + " c",
                                                        cache_salt=salt)
                _, plain, plain_engine = await complete(http, c.url, prefix + " d")
                text = await metrics_text(http, c.url)
                async with http.get(c.url + "/health") as h:
                    has_key = (await h.json())["manager_key"]
            assert has_key is True
            assert (plain_engine, cached(plain)) == (plain_holder, 48)
            assert (status, engine, cached(salted)) == (200, holder, 48)
            assert sample(text, "kvcm_router_manager_fallbacks_total", {"cause": "no-key"}) == 0
        finally:
            await c.close()


@pytest.mark.asyncio
async def test_streaming_through_the_kv_router(cluster):
    prefix = words("str", 32)
    async with aiohttp.ClientSession() as http:
        _, _, holder = await complete(http, cluster.url, prefix + " one")
        await cluster.wait_held(holder, prefix, 2)
        body = {"model": MODEL, "stream": True, "max_tokens": 4,
                "stream_options": {"include_usage": True}, "prompt": prefix + " two"}
        status, events, _ = await sse(http, cluster.url + "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    assert len([e for e in events[:-1] if e["choices"]]) == 4
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


@pytest.mark.asyncio
async def test_an_engine_that_goes_down_is_avoided_despite_its_cache(cluster):
    prefix = words("gone", 64)
    async with aiohttp.ClientSession() as http:
        _, _, holder = await complete(http, cluster.url, prefix + " a")
        await cluster.wait_held(holder, prefix, 4)
        other = "e1" if holder == "e0" else "e0"
        await cluster.served[holder].stop()  # the manager still lists its pages for now
        status, body, engine = await complete(http, cluster.url, prefix + " b")
        assert (status, engine) == (502, holder)
        assert f"engine {holder}" in body["error"]["message"]
        for i in range(3):
            status, answer, engine = await complete(http, cluster.url, prefix + f" c{i}")
            assert (status, engine) == (200, other)
        assert cached(answer) == 64  # the other engine computed it once, then kept it
        text = await metrics_text(http, cluster.url)
    # Refused, or a pooled connection the stopped engine closed.
    assert sum(sample(text, "kvcm_router_upstream_errors_total", {"engine": holder, "code": c})
               for c in ("connect", "disconnect")) == 1
    assert sample(text, "kvcm_router_engine_up", {"engine": holder}) == 0


def test_the_readme_demo_runs_from_the_command_line(manager, workdir):
    """Every piece started as the README starts it: two fake engines and the bridge and the
    router as commands, against the manager."""
    import json
    import sys
    import time
    import urllib.request

    from conftest import Process

    py = sys.executable
    ports = {name: free_port() for name in ("e0", "e1", "router")}
    zmq = {e: (free_port(), free_port()) for e in ("e0", "e1")}
    procs = []
    try:
        for e in ("e0", "e1"):
            pub, replay = zmq[e]
            procs.append(Process([py, "-m", "kvcm.testing.openai_engine", "--port",
                                  str(ports[e]), "--engine-id", e, "--model", MODEL,
                                  "--kv-events-endpoint", f"tcp://*:{pub}",
                                  "--replay-endpoint", f"tcp://*:{replay}"],
                                 workdir / f"{e}.log"))
        bridge = [py, "-m", "kvcm.engines.bridge", "--manager_address", manager.address, "--insecure",
                  "--tenant", TENANT, "--model", MODEL, "--preset", "llama-3-8b",
                  "--page_size_tokens", str(BLOCK)]
        for e in ("e0", "e1"):
            pub, replay = zmq[e]
            bridge += ["--engine", f"id={e},endpoint=tcp://127.0.0.1:{pub},"
                                   f"replay_endpoint=tcp://127.0.0.1:{replay},block_size={BLOCK}"]
        procs.append(Process(bridge, workdir / "bridge.log"))
        procs.append(Process(
            [py, "-m", "kvcm.router.server", "--listen_address", f"127.0.0.1:{ports['router']}",
             "--policy", "kv-aware", "--tokenizer", "words", "--manager_address", manager.address,
             "--insecure", "--tenant", TENANT, "--model", MODEL, "--preset", "llama-3-8b",
             "--block_size", str(BLOCK),
             "--engine", f"e0=http://127.0.0.1:{ports['e0']}",
             "--engine", f"e1=http://127.0.0.1:{ports['e1']}"], workdir / "router.log"))
        with kvcm.Client(manager.address, insecure=True) as client:
            end = time.monotonic() + 20
            while {e.engine_id for e in client.stats().engines} != {"e0", "e1"}:
                assert time.monotonic() < end, (workdir / "bridge.log").read_text()
                time.sleep(0.1)
        url = f"http://127.0.0.1:{ports['router']}/v1/completions"

        def complete(prompt: str) -> Tuple[str, int]:
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
            end = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(urllib.request.Request(
                            url, body, {"Content-Type": "application/json"}), timeout=10) as r:
                        answer = json.loads(r.read())
                        return (r.headers["x-kvcm-engine"],
                                answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                except OSError:  # the router is still starting
                    assert time.monotonic() < end, (workdir / "router.log").read_text()
                    time.sleep(0.1)

        prefix = words("demo", 48)
        first, cached_first = complete(prefix + " first question")
        assert cached_first == 0
        with kvcm.Client(manager.address, insecure=True) as client:
            client.register_model(NS, kvcm.ModelSpec.llama3_8b(page_size_tokens=BLOCK))
            hashes = client.hash_prompt(NS, WordTokenizer().encode(prefix))
            end = time.monotonic() + 10
            while client.route(NS, page_hashes=hashes, candidates=[first],
                               probe=True).ranked[0].cached_pages < 3:
                assert time.monotonic() < end, "the bridge did not publish the prefix"
                time.sleep(0.05)
        for i in range(3):
            assert complete(prefix + f" question {i}") == (first, 48)
    finally:
        for p in reversed(procs):
            p.stop()
