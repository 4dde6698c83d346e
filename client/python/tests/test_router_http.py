"""kvcm-router's HTTP front against fake OpenAI engines, without the manager (cache-blind
policies, and kv-aware falling back): passthrough, streaming, errors, models, metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("kvcm.testing.fake_vllm")

import aiohttp  # noqa: E402

from conftest import free_port  # noqa: E402
from rigs.router import (  # noqa: E402
    metrics_text,
    post,
    sample,
    sse,
    start_engine,
    start_router,
)

PROMPT = " ".join(f"w{i}" for i in range(40))  # 40 words: 2 whole blocks of 16


@pytest.mark.asyncio
async def test_completions_and_chat_pass_through_with_usage():
    e0, s0 = await start_engine("e0")
    e1, s1 = await start_engine("e1")
    router, rs = await start_router([("e0", s0.url), ("e1", s1.url)], "round-robin")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 5}
            direct_status, direct, _ = await post(http, s0.url + "/v1/completions", body)
            answers = [await post(http, rs.url + "/v1/completions", body) for _ in range(4)]
            assert [a[2] for a in answers] == ["e0", "e1", "e0", "e1"]
            assert all(a[0] == 200 for a in answers)
            # Deterministic engines: the same text through the router as directly.
            assert {a[1]["choices"][0]["text"] for a in answers} == {
                direct["choices"][0]["text"]}
            assert answers[0][1]["kvcm_engine"] == "e0" and answers[1][1]["kvcm_engine"] == "e1"
            # e0 saw the prompt directly first: its 2 blocks (32 tokens) are cached for both
            # routed requests; e1 computes it once, then hits.
            cached = [a[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
            assert cached == [32, 0, 32, 32]
            chat = {"model": "fake-model", "max_tokens": 3,
                    "messages": [{"role": "user", "content": PROMPT}]}
            status, answer, engine = await post(http, rs.url + "/v1/chat/completions", chat)
            assert status == 200 and engine == "e0"
            assert answer["object"] == "chat.completion"
            assert len(answer["choices"][0]["message"]["content"].split()) == 3
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_engine_cached_tokens_total", {"engine": "e1"}) == 32
            assert sample(text, "kvcm_router_requests_total",
                          {"engine": "e0", "policy": "round-robin",
                           "endpoint": "/v1/chat/completions"}) == 1
            assert sample(text, "kvcm_router_prompt_tokens_total", {"engine": "e0"}) == \
                2 * 40 + answer["usage"]["prompt_tokens"]
            assert sample(text, "kvcm_router_in_flight_requests", {"engine": "e0"}) == 0
            assert sample(text, "kvcm_router_route_seconds_count",
                          {"policy": "round-robin"}) == 5
    finally:
        for s in (rs, s0, s1):
            await s.stop()


@pytest.mark.asyncio
async def test_streaming_is_passed_through_chunk_by_chunk():
    e0, s0 = await start_engine("e0", decode_ms_per_token=20)
    router, rs = await start_router([("e0", s0.url)], "least-loaded")
    try:
        async with aiohttp.ClientSession() as http:
            plain = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 6}
            _, whole, _ = await post(http, s0.url + "/v1/completions", plain)
            body = dict(plain, stream=True, stream_options={"include_usage": True})
            async with http.post(rs.url + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-kvcm-engine"] == "e0"
                assert r.headers["Content-Type"].startswith("text/event-stream")
                first = await r.content.readuntil(b"\n\n")
                # The first token arrives before the engine has finished decoding.
                text = await metrics_text(http, rs.url)
                assert sample(text, "kvcm_router_in_flight_requests", {"engine": "e0"}) == 1
                assert sample(text, "kvcm_router_queued_prefill_tokens", {"engine": "e0"}) == 0
                rest = await r.read()
            raw = first + rest
            events = [b[6:] for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            import json

            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert text == whole["choices"][0]["text"]
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            status, chat_events, _ = await sse(http, rs.url + "/v1/chat/completions", {
                "model": "fake-model", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and chat_events[-1] == "[DONE]"
            assert chat_events[0]["choices"][0]["delta"]["role"] == "assistant"
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_engine_cached_tokens_total", {"engine": "e0"}) == 32
            assert sample(text, "kvcm_router_in_flight_requests", {"engine": "e0"}) == 0
    finally:
        await rs.stop()
        await s0.stop()


@pytest.mark.asyncio
async def test_a_client_leaving_mid_stream_is_not_an_engine_failure():
    e0, s0 = await start_engine("e0", decode_ms_per_token=50)
    router, rs = await start_router([("e0", s0.url)], "least-loaded")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 40, "stream": True}
            async with http.post(rs.url + "/v1/completions", json=body) as r:
                await r.content.readuntil(b"\n\n")
                r.connection.transport.abort()  # gone after the first token
        async with aiohttp.ClientSession() as http:
            async def settled() -> bool:
                text = await metrics_text(http, rs.url)
                return sample(text, "kvcm_router_in_flight_requests", {"engine": "e0"}) == 0

            for _ in range(100):
                if await settled():
                    break
                await asyncio.sleep(0.05)
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_in_flight_requests", {"engine": "e0"}) == 0
            assert sample(text, "kvcm_router_engine_up", {"engine": "e0"}) == 1
            assert "kvcm_router_upstream_errors_total{" not in text
            status, _, engine = await post(http, rs.url + "/v1/completions",
                                           {"model": "fake-model", "prompt": "a"})
            assert (status, engine) == (200, "e0")
    finally:
        await rs.stop()
        await s0.stop()


@pytest.mark.asyncio
async def test_engine_down_is_502_naming_it_and_then_avoided():
    e0, s0 = await start_engine("e0")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router, rs = await start_router([("e0", s0.url), ("e1", dead)], "round-robin")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 2}
            results = [await post(http, rs.url + "/v1/completions", body) for _ in range(2)]
            assert [r[0] for r in results] == [200, 502]
            error = results[1][1]["error"]
            assert "engine e1" in error["message"] and dead in error["message"]
            assert "unreachable" in error["message"] and error["type"] == "upstream_unavailable"
            later = [await post(http, rs.url + "/v1/completions", body) for _ in range(4)]
            assert [(r[0], r[2]) for r in later] == [(200, "e0")] * 4
            async with http.get(rs.url + "/health") as h:
                health = await h.json()
            assert h.status == 200 and health["engines"] == {"e0": True, "e1": False}
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_upstream_errors_total",
                          {"engine": "e1", "code": "connect"}) == 1
            assert sample(text, "kvcm_router_engine_up", {"engine": "e1"}) == 0
            assert sample(text, "kvcm_router_in_flight_requests", {"engine": "e1"}) == 0
    finally:
        await rs.stop()
        await s0.stop()


@pytest.mark.asyncio
async def test_engine_errors_pass_through_and_bad_requests_are_400():
    e0, s0 = await start_engine("e0", num_blocks=4)  # 64 tokens of cache
    router, rs = await start_router([("e0", s0.url)], "least-loaded")
    try:
        async with aiohttp.ClientSession() as http:
            url = rs.url + "/v1/completions"
            status, body, engine = await post(http, url, {"model": "nope", "prompt": "a b"})
            assert (status, engine) == (404, "e0") and "nope" in body["message"]
            long_prompt = " ".join(f"x{i}" for i in range(100))
            status, body, _ = await post(http, url, {"model": "fake-model",
                                                     "prompt": long_prompt})
            assert status == 400 and "does not fit" in body["message"]
            status, body, engine = await post(http, url, {"model": "fake-model"})
            assert (status, engine) == (400, None) and body["error"]["message"].startswith(
                "prompt:")
            status, body, _ = await post(http, url, {"prompt": "a", "cache_salt": 5})
            assert status == 400 and body["error"]["message"].startswith("cache_salt:")
            async with http.post(url, data=b"{not json") as r:
                assert r.status == 400 and "body: not JSON" in (await r.json())["error"][
                    "message"]
            text = await metrics_text(http, rs.url)
            assert sample(text, "kvcm_router_upstream_errors_total",
                          {"engine": "e0", "code": "404"}) == 1
            assert sample(text, "kvcm_router_upstream_errors_total",
                          {"engine": "e0", "code": "400"}) == 1
            assert sample(text, "kvcm_router_engine_up", {"engine": "e0"}) == 1
    finally:
        await rs.stop()
        await s0.stop()


@pytest.mark.asyncio
async def test_models_are_merged_from_the_engines():
    e0, s0 = await start_engine("e0", lora_adapters=("sql-lora",))
    e1, s1 = await start_engine("e1", lora_adapters=("chat-lora",))
    router, rs = await start_router([("e0", s0.url), ("e1", s1.url)], "round-robin")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(rs.url + "/v1/models") as r:
                models = await r.json()
            assert r.status == 200 and models["object"] == "list"
            assert sorted(m["id"] for m in models["data"]) == ["chat-lora", "fake-model",
                                                               "sql-lora"]
    finally:
        for s in (rs, s0, s1):
            await s.stop()


@pytest.mark.asyncio
async def test_kv_aware_serves_least_loaded_while_the_manager_is_down():
    e0, s0 = await start_engine("e0", decode_ms_per_token=30)
    e1, s1 = await start_engine("e1", decode_ms_per_token=30)
    router, rs = await start_router([("e0", s0.url), ("e1", s1.url)], "kv-aware",
                                    manager_address=f"127.0.0.1:{free_port()}", insecure=True,
                                    route_deadline_ms=100)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 5}
            results = await asyncio.gather(*[post(http, rs.url + "/v1/completions", body)
                                             for _ in range(6)])
            assert [r[0] for r in results] == [200] * 6
            assert sorted(r[2] for r in results) == ["e0"] * 3 + ["e1"] * 3
            text = await metrics_text(http, rs.url)
            assert sum(sample(text, "kvcm_router_manager_fallbacks_total", {"cause": c})
                       for c in ("unavailable", "no-key", "deadline")) == 6
            assert sample(text, "kvcm_router_decisions_total",
                          {"policy": "kv-aware", "reason": "fallback"}) == 6
            async with http.get(rs.url + "/health") as h:
                assert (await h.json())["manager_key"] is False
    finally:
        for s in (rs, s0, s1):
            await s.stop()


def test_cli_refuses_a_bad_configuration_naming_the_setting(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text('policy = "kv-aware"\ntokenizer = "words"\n'
                      'engines = ["e0=http://127.0.0.1:1"]\n')
    run = subprocess.run([sys.executable, "-m", "kvcm.router.server", "--config", str(config)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "manager_address: required by policy kv-aware" in run.stderr
    run = subprocess.run([sys.executable, "-m", "kvcm.router.server", "--tokenizer", "words",
                          "--engine", "e0", "--policy", "round-robin"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "--engine: 'e0' must be ID=URL" in run.stderr
    config.write_text('policy = "round-robin"\nbogus = 1\n')
    run = subprocess.run([sys.executable, "-m", "kvcm.router.server", "--config", str(config)],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "bogus: unknown setting" in run.stderr
