"""kvcm-router's prefill/decode disaggregation without real engines: the prefill request,
the decode choice, agent-mapped ranking, the configuration, and the HTTP flow over fake
engines (prefill then decode, streaming, a prefill engine down)."""

from __future__ import annotations

import subprocess
import sys
from typing import List, Sequence

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("kvcm.testing.fake_vllm")

import aiohttp  # noqa: E402

from conftest import free_port  # noqa: E402
from rigs.router import Served, metrics_text, post, sample, sse, start_engine  # noqa: E402

from kvcm.router import ImbalanceGuard, LoadTracker, RoutingRequest  # noqa: E402
from kvcm.router.config import (  # noqa: E402
    ConfigError,
    EngineSpec,
    NamespaceConfig,
    RouterConfig,
    load_config,
)
from kvcm.router.pd import AgentMappedIndex, DecodePolicy, prefill_body  # noqa: E402
from kvcm.router.server import RouterServer  # noqa: E402
from kvcm.types import AttentionKind, RankedAgent, RouteCandidate  # noqa: E402

PROMPT = " ".join(f"w{i}" for i in range(40))  # 40 words: 2 whole blocks of 16
AGENTS = {"p0": "gpu0", "p1": "gpu1", "d0": "gpu1", "d1": "gpu0", "d2": "gpu0"}


def test_the_prefill_request_asks_for_one_token_unstreamed_and_keeps_the_rest():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "n": 2, "min_tokens": 5,
            "temperature": 0.0, "logprobs": 1, "cache_salt": "s"}
    out = prefill_body(body, chat=False)
    assert out == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "n": 1,
                   "temperature": 0.0, "logprobs": 1, "cache_salt": "s"}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    assert prefill_body(chat, chat=True) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 1, "stream": False, "n": 1}
    assert prefill_body({**chat, "max_completion_tokens": 9}, chat=True)[
        "max_completion_tokens"] == 1


@pytest.mark.asyncio
async def test_decode_goes_to_the_least_loaded_engine_on_the_prefill_engines_agent():
    loads = LoadTracker(["d0", "d1", "d2"])
    policy = DecodePolicy(AGENTS, block_size=16, guard=ImbalanceGuard(2.0, 1))
    near_gpu0 = RoutingRequest(list(range(40)), kv_agent="gpu0")
    d = await policy.choose(near_gpu0, ["d0", "d1", "d2"], loads)
    # d1 and d2 share gpu0; whole blocks before the last token are expected loaded (32).
    assert d.engine_id in ("d1", "d2") and d.reason == "policy"
    assert d.expected_cached_tokens == 32
    loads.begin("d1", 40, 32)
    assert (await policy.choose(near_gpu0, ["d0", "d1", "d2"], loads)).engine_id == "d2"
    # Both gpu0 engines beyond the guard (in_flight 2 > 2 * 0 + 1): the least loaded, d0,
    # which finds nothing on its agent.
    for e in ("d1", "d2", "d2"):
        loads.begin(e, 40, 32)
    d = await policy.choose(near_gpu0, ["d0", "d1", "d2"], loads)
    assert (d.engine_id, d.reason, d.expected_cached_tokens) == ("d0", "imbalance-guard", 0)
    # No prefill (it failed): least-loaded, nothing expected cached.
    d = await policy.choose(RoutingRequest(list(range(40))), ["d0", "d1", "d2"], loads)
    assert (d.engine_id, d.reason, d.expected_cached_tokens) == ("d0", "policy", 0)
    # The agent's engines are all unavailable: another one.
    d = await policy.choose(near_gpu0, ["d0"], loads)
    assert d.engine_id == "d0"


class AgentIndex:
    """Fake manager: fixed cached pages per agent; records the candidates it was asked."""

    def __init__(self, cached: dict) -> None:
        self.cached = cached
        self.calls: List[List[RouteCandidate]] = []

    async def rank(self, request: RoutingRequest,
                   candidates: Sequence[RouteCandidate]) -> List[RankedAgent]:
        self.calls.append(list(candidates))
        out = [RankedAgent(c.agent_id, self.cached.get(c.agent_id, 0), 0, 0, 0.0,
                           self.cached.get(c.agent_id, 0) * 10.0, 0.0, c.load, 0.0)
               for c in candidates]
        return sorted(out, key=lambda r: -r.saved_prefill_ms)


@pytest.mark.asyncio
async def test_agent_mapped_index_asks_once_per_agent_and_charges_each_engines_queue():
    inner = AgentIndex({"gpu0": 3})
    index = AgentMappedIndex(inner, AGENTS, prefill_tokens_per_s=1000.0)
    candidates = [RouteCandidate("p0", load=2, queued_prefill_tokens=10),  # gpu0: 3 pages
                  RouteCandidate("d1", load=0, queued_prefill_tokens=0),  # gpu0 too
                  RouteCandidate("p1", load=0, queued_prefill_tokens=0),  # gpu1: nothing
                  RouteCandidate("x", load=0, queued_prefill_tokens=0)]  # its own agent
    ranked = await index.rank(RoutingRequest(list(range(64))), candidates)
    # One candidate per agent, with its least-loaded engine's load.
    assert [(c.agent_id, c.load) for c in inner.calls[0]] == [("gpu0", 0), ("gpu1", 0),
                                                              ("x", 0)]
    # saved 30 ms for gpu0's engines; p0 pays 10 ms of queue; the empty agents tie on load.
    assert [(r.agent_id, r.cached_pages) for r in ranked] == [("d1", 3), ("p0", 3), ("p1", 0),
                                                             ("x", 0)]
    assert ranked[1].queue_ms == pytest.approx(10.0) and ranked[1].load == 2


def test_pd_configuration_from_toml_and_flags(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text('''
policy = "kv-aware"
tokenizer = "words"
prefill_engines = ["p0=http://127.0.0.1:8001"]
decode_engines = ["d0=http://127.0.0.1:8002/v1", "d1=http://127.0.0.1:8003"]
engine_agents = ["p0=gpu0", "d0=gpu0"]
manager = "127.0.0.1:50051"
insecure = true
[namespace]
tenant = "acme"
model = "tiny-llama"
block_size = 32
[namespace.spec]
attention = "gqa"
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 64
''')
    cfg = load_config(["--config", str(config)])
    assert cfg.pd and not cfg.engines
    assert [e.id for e in cfg.all_engines] == ["p0", "d0", "d1"]
    assert cfg.decode_engines[0] == EngineSpec("d0", "http://127.0.0.1:8002")
    assert cfg.engine_agents == {"p0": "gpu0", "d0": "gpu0"}
    spec = cfg.namespace.model_spec()
    assert (spec.attention, spec.num_layers, spec.num_kv_heads, spec.head_dim,
            spec.page_size_tokens) == (AttentionKind.GQA, 2, 2, 64, 32)
    cfg = load_config(["--config", str(config), "--decode_engine", "d9=http://h:1",
                       "--engine_agent", "d9=gpu9"])
    assert [e.id for e in cfg.decode_engines] == ["d9"] and cfg.engine_agents == {"d9": "gpu9"}
    for argv, message in [
        (["--engine", "e0=http://h:1"], "engines: not with prefill_engines"),
        (["--decode_engine", "p0=http://h:1"], "id 'p0' is listed twice"),
        (["--engine_agent", "zz=gpu0"], "engine_agents: 'zz' is not a configured engine"),
        (["--engine_agent", "p0"], "--engine_agent: 'p0' must be ENGINE=AGENT"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(["--config", str(config), *argv])
    with pytest.raises(ConfigError, match="P/D needs at least one"):
        load_config(["--tokenizer", "words", "--policy", "least-loaded",
                     "--prefill_engine", "p0=http://h:1"])
    run = subprocess.run([sys.executable, "-m", "kvcm.router.server", "--tokenizer", "words",
                          "--policy", "least-loaded", "--decode_engine", "d0=http://h:1"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "P/D needs at least one" in run.stderr


async def start_pd_router(prefill: list, decode: list, **kw) -> Served:
    cfg = RouterConfig(policy="least-loaded", tokenizer="words",
                       prefill_engines=[EngineSpec(i, u) for i, u in prefill],
                       decode_engines=[EngineSpec(i, u) for i, u in decode],
                       namespace=NamespaceConfig(block_size=16), engine_down_s=30.0, **kw)
    port = free_port()
    cfg.listen_address = f"127.0.0.1:{port}"
    return await Served(RouterServer(cfg).app, port).start()


@pytest.mark.asyncio
async def test_pd_prefills_then_decodes_on_the_prefill_engines_agent():
    p0, sp0 = await start_engine("p0")
    d0, sd0 = await start_engine("d0")
    d1, sd1 = await start_engine("d1")
    rs = await start_pd_router([("p0", sp0.url)], [("d0", sd0.url), ("d1", sd1.url)],
                               engine_agents={"p0": "gpu0", "d1": "gpu0", "d0": "gpu1"})
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 5}
            _, direct, _ = await post(http, sd0.url + "/v1/completions", body)
            for _ in range(2):
                status, answer, engine = await post(http, rs.url + "/v1/completions", body)
                assert (status, engine) == (200, "d1")  # d1 shares p0's agent
                assert answer["choices"][0]["text"] == direct["choices"][0]["text"]
            chat = {"model": "fake-model", "max_tokens": 3, "stream": True,
                    "messages": [{"role": "user", "content": PROMPT}]}
            status, events, _ = await sse(http, rs.url + "/v1/chat/completions", chat)
            assert status == 200 and events[-1] == "[DONE]"
            assert len("".join(e["choices"][0]["delta"].get("content", "")
                               for e in events[:-1] if e["choices"]).split()) == 3
            # A prompt of less than one block and a token: nothing to prefill apart.
            short = {"model": "fake-model", "prompt": "a b c", "max_tokens": 2}
            status, _, engine = await post(http, rs.url + "/v1/completions", short)
            assert (status, engine) == (200, "d0")  # least-loaded: nothing on an agent
            assert (p0.requests, d1.requests, d0.requests) == (3, 3, 2)
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_requests_total",
                          {"engine": "p0", "policy": "least-loaded",
                           "endpoint": "/v1/completions"}) == 2
            assert sample(text, "kvcm_router_requests_total",
                          {"engine": "d1", "policy": "pd-decode",
                           "endpoint": "/v1/chat/completions"}) == 1
            assert sample(text, "kvcm_router_pd_prefill_fallbacks_total", {}) == 0
            for e in ("p0", "d1"):
                assert sample(text, "kvcm_router_in_flight_requests", {"engine": e}) == 0
            async with http.get(rs.url + "/health") as h:
                health = await h.json()
            assert health["pd"] is True and set(health["engines"]) == {"p0", "d0", "d1"}
    finally:
        for s in (rs, sp0, sd0, sd1):
            await s.stop()


@pytest.mark.asyncio
async def test_a_prefill_engine_down_or_failing_falls_back_to_decode_alone():
    d0, sd0 = await start_engine("d0")
    p1, sp1 = await start_engine("p1", num_blocks=1)  # 16 tokens: the prompt is a 400
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rs = await start_pd_router([("p0", dead)], [("d0", sd0.url)])
    rs1 = await start_pd_router([("p1", sp1.url)], [("d0", sd0.url)])
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 5}
            _, direct, _ = await post(http, sd0.url + "/v1/completions", body)
            status, answer, engine = await post(http, rs.url + "/v1/completions", body)
            assert (status, engine) == (200, "d0")
            assert answer["choices"][0]["text"] == direct["choices"][0]["text"]
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_pd_prefill_fallbacks_total",
                          {"cause": "connect"}) == 1
            assert sample(text, "kvcm_router_upstream_errors_total",
                          {"engine": "p0", "code": "connect"}) == 1
            assert sample(text, "kvcm_router_engine_up", {"engine": "p0"}) == 0
            assert sample(text, "kvcm_router_in_flight_requests", {"engine": "p0"}) == 0
            # An engine's HTTP error: the decode engine still answers; p1 is not avoided.
            status, answer, engine = await post(http, rs1.url + "/v1/completions", body)
            assert (status, engine) == (200, "d0")
            text = await metrics_text(http, rs1.url)
            assert sample(text, "kvcm_router_pd_prefill_fallbacks_total",
                          {"cause": "400"}) == 1
            assert sample(text, "kvcm_router_engine_up", {"engine": "p1"}) == 1
    finally:
        for s in (rs, rs1, sd0, sp1):
            await s.stop()
