"""kvcm-router against hostile engines and unauthenticated clients (issue 35): a kvcm-router
process on loopback, in front of small HTTP servers written here (the attacker is not vLLM).

- an engine's redirect is never followed: the client gets a 502 naming it and the redirect's
  target gets no request (plain and P/D prefill);
- a non-streamed answer over max_response_bytes is cut with a 502 naming the limit, and the
  router's peak RSS stays far below the answer; a huge streamed answer passes through without
  being buffered;
- with tokens_file, a client without a token, with a wrong one or another tenant's is refused
  (401 / 403) before any engine sees the request; the engine gets the token's tenant, never
  the client's claim or its token;
- the default listen address is loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from conftest import Process, free_port  # noqa: E402
from rigs.router import Served  # noqa: E402
from kvcm.router.config import load_config  # noqa: E402

PROMPT = " ".join(f"w{i}" for i in range(40))  # 2 whole blocks of 16: P/D prefills it
MIB = 1 << 20
WORKER = "worker-token-acme-0123456789"
OTHER_TENANT = "worker-token-globex-012345678"
AGENT = "agent-token-gpu0-0123456789ab"
ADMIN = "admin-token-ops-0123456789abc"
TOKENS = {WORKER: "acme-worker roles=worker tenant=acme",
          OTHER_TENANT: "globex-worker roles=worker tenant=globex",
          AGENT: "gpu-0 roles=agent agent=gpu-0",
          ADMIN: "ops roles=admin"}


class Recorder:
    """An HTTP server that answers everything 200 and remembers each request."""

    def __init__(self) -> None:
        self.requests: List[Tuple[str, str, Dict[str, str]]] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self._any)

    async def _any(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests.append((request.method, request.path, dict(request.headers)))
        return web.json_response({"object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "finish_reason": "stop"}]})


class HostileEngine:
    """An "engine" whose answer to completions is chosen by the test."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.redirect_to = ""
        self.seen: List[Dict[str, str]] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_get("/v1/models", self._models)

    async def _models(self, request: web.Request) -> web.Response:
        if self.mode.startswith("redirect"):
            raise web.HTTPFound(self.redirect_to)
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(dict(request.headers))
        if self.mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.redirect_to)  # 307 keeps the POST
        if self.mode == "redirect-prefill" and body.get("max_tokens") == 1:
            raise web.HTTPTemporaryRedirect(self.redirect_to)
        if self.mode in ("huge", "huge-sse", "huge-declared"):
            sse = self.mode == "huge-sse"
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream" if sse else "application/json"})
            if self.mode == "huge-declared":
                resp.content_length = 1 << 30
            await resp.prepare(request)
            chunk = b"x" * MIB  # no newline: nothing to split on either
            for _ in range(96):
                try:
                    await resp.write(chunk)
                except ConnectionError:
                    return resp
            if sse:
                await resp.write(b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"object": "text_completion", "choices": [
            {"index": 0, "text": "fine", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}})


class RouterProcess(Process):
    def __init__(self, tmp: Path, engines: List[Tuple[str, str]], *, pd: bool = False,
                 extra: Optional[List[str]] = None, listen_host: str = "127.0.0.1") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kvcm.router.server", "--policy", "round-robin",
                "--tokenizer", "words", "--listen_address", f"{listen_host}:{self.port}",
                "--tenant", "acme", "--block_size", "16", "--log_level", "warning"]
        if pd:
            args += ["--prefill_engine", f"{engines[0][0]}={engines[0][1]}",
                     "--decode_engine", f"{engines[1][0]}={engines[1][1]}"]
        else:
            for i, u in engines:
                args += ["--engine", f"{i}={u}"]
        super().__init__(args + (extra or []), tmp / f"router-{self.port}.log")

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited: {self.log.read_text()}")
            try:
                async with http.get(self.url + "/health") as r:
                    if r.status in (200, 503):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"router did not start: {self.log.read_text()}")


async def _post(http: aiohttp.ClientSession, url: str, body: Dict[str, Any],
                headers: Optional[Dict[str, str]] = None) -> Tuple[int, Any]:
    async with http.post(url, json=body, headers=headers or {}) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw


@pytest.mark.asyncio
async def test_redirects_are_never_followed(tmp_path):
    target = Recorder()
    ts = await Served(target.app, free_port()).start()
    hostile = HostileEngine()
    hostile.redirect_to = ts.url + "/metrics"
    hs = await Served(hostile.app, free_port()).start()
    decode = Recorder()
    ds = await Served(decode.app, free_port()).start()
    plain = RouterProcess(tmp_path, [("evil", hs.url)])
    pd = RouterProcess(tmp_path, [("evil", hs.url), ("d0", ds.url)], pd=True)
    try:
        async with aiohttp.ClientSession() as http:
            await plain.wait_ready(http)
            await pd.wait_ready(http)
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
            hostile.mode = "redirect"
            status, answer = await _post(http, plain.url + "/v1/completions", body)
            assert status == 502, answer
            assert answer["error"]["type"] == "upstream_redirect"
            assert "HTTP 307" in answer["error"]["message"]
            assert "does not follow" in answer["error"]["message"]
            async with http.get(plain.url + "/v1/models") as r:
                assert r.status == 502
            # P/D: the prefill engine redirects the prompt; the decode engine serves it.
            hostile.mode = "redirect-prefill"
            status, answer = await _post(http, pd.url + "/v1/completions", body)
            assert status == 200, answer
            assert len(decode.requests) == 1
            async with http.get(pd.url + "/metrics") as r:
                text = await r.text()
            assert 'kvcm_router_pd_prefill_fallbacks_total{cause="redirect"} 1.0' in text
            async with http.get(plain.url + "/metrics") as r:
                text = await r.text()
            assert 'kvcm_router_upstream_errors_total{code="redirect",engine="evil"} 1.0' \
                in text
            await asyncio.sleep(0.2)
        assert target.requests == [], "the redirect's target was reached"
    finally:
        plain.stop()
        pd.stop()
        for s in (ts, hs, ds):
            await s.stop()


@pytest.mark.asyncio
async def test_huge_answers_are_cut_or_streamed_with_bounded_memory(tmp_path):
    hostile = HostileEngine()
    hs = await Served(hostile.app, free_port()).start()
    router = RouterProcess(tmp_path, [("evil", hs.url)],
                           extra=["--max_response_bytes", str(8 * MIB)])
    try:
        async with aiohttp.ClientSession() as http:
            await router.wait_ready(http)
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
            assert (await _post(http, router.url + "/v1/completions", body))[0] == 200
            base = router.status("VmRSS")
            for mode in ("huge", "huge-declared"):
                hostile.mode = mode
                status, answer = await _post(http, router.url + "/v1/completions", body)
                assert status == 502, answer
                assert answer["error"]["type"] == "upstream_too_large"
                assert f"max_response_bytes = {8 * MIB}" in answer["error"]["message"]
            # 96 MiB streamed (one line without a newline) passes through whole.
            hostile.mode = "huge-sse"
            n = 0
            async with http.post(router.url + "/v1/completions",
                                 json=dict(body, stream=True)) as r:
                assert r.status == 200
                async for chunk in r.content.iter_any():
                    n += len(chunk)
            assert n >= 96 * MIB
            peak = router.status("VmHWM")
            # The 96 MiB answers went through a process that grew by far less.
            assert peak - base < 40 * MIB, (base, peak)
            # The router still serves.
            hostile.mode = "ok"
            assert (await _post(http, router.url + "/v1/completions", body))[0] == 200
            async with http.get(router.url + "/metrics") as r:
                text = await r.text()
            assert 'kvcm_router_upstream_errors_total{code="too-large",engine="evil"} 2.0' \
                in text
    finally:
        router.stop()
        await hs.stop()


@pytest.mark.asyncio
async def test_clients_need_a_token_of_the_routers_tenant(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{hashlib.sha256(t.encode()).hexdigest()} {rest}\n"
                              for t, rest in TOKENS.items()))
    engine = HostileEngine()
    es = await Served(engine.app, free_port()).start()
    router = RouterProcess(tmp_path, [("e0", es.url)], extra=["--tokens_file", str(tokens)])
    try:
        async with aiohttp.ClientSession() as http:
            await router.wait_ready(http)
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "tenant": "acme"}
            url = router.url + "/v1/completions"
            refusals = [
                ({}, 401, "missing"),
                ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "malformed"),
                ({"Authorization": "Bearer short"}, 401, "malformed"),
                ({"Authorization": "Bearer not-a-known-token-0123456789"}, 401, "unknown"),
                ({"Authorization": f"Bearer {OTHER_TENANT}", "x-kvcm-tenant": "acme"}, 403,
                 "tenant"),
                ({"Authorization": f"Bearer {AGENT}"}, 403, "role"),
            ]
            for headers, want, reason in refusals:
                status, answer = await _post(http, url, body, headers)
                assert status == want, (headers, answer)
                assert answer["error"]["code"] == want
            assert engine.seen == [], "a refused request reached the engine"
            async with http.get(router.url + "/v1/models") as r:
                assert r.status == 401
            async with http.get(router.url + "/health") as r:
                assert r.status == 200  # probes need no token
            status, answer = await _post(
                http, url, body, {"Authorization": f"Bearer {WORKER}",
                                  "x-kvcm-tenant": "globex"})
            assert status == 200, answer
            status, _ = await _post(http, url, body, {"Authorization": f"Bearer {ADMIN}"})
            assert status == 200
            seen = [{k.lower(): v for k, v in h.items()} for h in engine.seen]
            assert [h.get("x-kvcm-tenant") for h in seen] == ["acme", "acme"]
            assert all("authorization" not in h for h in seen), "the token reached the engine"
            async with http.get(router.url + "/metrics") as r:
                text = await r.text()
            for reason, n in (("missing", 2), ("malformed", 2), ("unknown", 1), ("tenant", 1),
                              ("role", 1)):
                assert f'kvcm_router_client_refusals_total{{reason="{reason}"}} {n}.0' in text
    finally:
        router.stop()
        await es.stop()


def test_listen_address_is_loopback_by_default(tmp_path):
    cfg = load_config(["--policy", "round-robin", "--tokenizer", "words",
                       "--engine", "e0=http://127.0.0.1:1"])
    assert cfg.listen_host_port == ("127.0.0.1", 8100)
    assert cfg.tokens_file == "" and cfg.max_response_bytes == 16 * MIB


@pytest.mark.asyncio
async def test_a_wide_listener_without_tokens_is_announced(tmp_path):
    router = RouterProcess(tmp_path, [("e0", "http://127.0.0.1:1")], listen_host="0.0.0.0")
    try:
        async with aiohttp.ClientSession() as http:
            await router.wait_ready(http)
        await asyncio.sleep(0.2)
        assert "without tokens_file" in router.log.read_text()
    finally:
        router.stop()
