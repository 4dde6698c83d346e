"""kvcm-router: an OpenAI-compatible HTTP front that sends each request to one engine.

POST /v1/completions and /v1/chat/completions are passed through unchanged (streamed SSE
too) to the engine the policy picks; GET /v1/models merges the engines' lists; /metrics is
Prometheus text; /health says which engines are avoided. Answers carry `x-kvcm-engine`
(the engine id). An engine that does not answer (refused, reset, timed out) gives 502 / 504
naming it and is avoided for a while; an engine's own HTTP errors pass through unchanged.
Engines are not trusted: their redirects are never followed (a 3xx is a 502 naming it), and
a non-streamed answer over `max_response_bytes` is cut with a 502 naming the limit. With
`tokens_file`, clients must send a bearer token of the router's tenant (kvcm.router.auth).
With prefill_engines / decode_engines (P/D), a request is first prefilled on a prefill engine
(max_tokens 1), then passed unchanged to a decode engine (kvcm.router.pd).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
from typing import Any, Dict, List, Optional

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcm import aio as kvcm_aio
from kvcm._net import is_loopback_host
from kvcm.router.auth import ClientAuth
from kvcm.router.config import ConfigError, RouterConfig, load_config
from kvcm.router.core import Router, make_policy
from kvcm.router.load import LoadTracker, Ticket
from kvcm.router.manager_index import ManagerIndex
from kvcm.router.metrics import RouterMetrics
from kvcm.router.pd import AgentMappedIndex, DecodePolicy, agent_of, prefill_body
from kvcm.router.policy import ImbalanceGuard, PrefixIndex, RoutingRequest, cacheable_tokens
from kvcm.router.tokenizer import (
    Tokenizer,
    TokenizerError,
    has_non_text_parts,
    load_tokenizer,
    prompt_tokens,
)

log = logging.getLogger("kvcm.router")

ENGINE_HEADER = "x-kvcm-engine"
# Set on requests to engines from the client's token (tokens_file); dropped otherwise.
TENANT_HEADER = "x-kvcm-tenant"
# Request headers never forwarded (hop-by-hop, or recomputed by the client library).
_DROP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                 "te", "trailer", "upgrade", "proxy-authorization", "proxy-authenticate",
                 "accept-encoding"}
# Where an SSE line may end: a longer unterminated tail is dropped, not kept growing.
_SSE_MAX_LINE = 1 << 20
# Endpoints a client needs no token for (probes and Prometheus, as the manager's health
# service and /metrics).
_OPEN_PATHS = {"/health", "/metrics"}


class _TooLarge(Exception):
    """An engine answer over max_response_bytes."""


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or _TooLarge once more than `cap` bytes came (the rest is not read)."""
    declared = resp.content_length
    if declared is not None and declared > cap:
        raise _TooLarge()
    parts, n = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        n += len(chunk)
        if n > cap:
            raise _TooLarge()
        parts.append(chunk)
    return b"".join(parts)


def error_response(status: int, message: str, kind: str,
                   engine: Optional[str] = None) -> web.Response:
    """An OpenAI-style error body."""
    headers = {ENGINE_HEADER: engine} if engine else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def cached_tokens_of(usage: Any) -> Optional[int]:
    """usage.prompt_tokens_details.cached_tokens, when the engine reported it."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


class _SseUsage:
    """Finds the usage in an SSE stream passing through (vLLM sends it in a last chunk when
    stream_options.include_usage is set)."""

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: Optional[int] = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > _SSE_MAX_LINE:
            self._tail = b""  # no usage line is this long: do not buffer it
        for line in lines:
            if line.startswith(b"data:") and b"cached_tokens" in line:
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    continue
                if isinstance(event, dict):
                    found = cached_tokens_of(event.get("usage"))
                    if found is not None:
                        self.cached_tokens = found


class RouterServer:
    """The aiohttp application of one router. Build it inside the event loop that serves it
    (the manager client binds to that loop at startup)."""

    def __init__(self, cfg: RouterConfig, *, tokenizer: Optional[Tokenizer] = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
        self.engines = {e.id: e for e in cfg.all_engines}
        self.metrics = RouterMetrics()
        self.loads = LoadTracker(self.engines, down_s=cfg.engine_down_s)
        self.index: Optional[ManagerIndex] = None
        self._clients: List[kvcm_aio.Client] = []
        self._session: Optional[aiohttp.ClientSession] = None
        # P/D: `router` chooses the decode engine, `prefill_router` the prefill engine.
        self.router: Optional[Router] = None
        self.prefill_router: Optional[Router] = None
        self.auth = (ClientAuth(cfg.tokens_file, cfg.namespace.tenant)
                     if cfg.tokens_file else None)
        self.app = web.Application(middlewares=[self._authenticate])
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With a tokens file: the bearer token first, before the body is read."""
        if self.auth is None or request.path in _OPEN_PATHS:
            return await handler(request)
        principal, tenant, refusal = self.auth.check(request.headers.get("Authorization"))
        if refusal is not None:
            self.metrics.client_refusals.labels(refusal.reason).inc()
            resp = error_response(refusal.status, refusal.message,
                                  "authentication_error" if refusal.status == 401
                                  else "permission_error")
            if refusal.status == 401:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="kvcm-router"'
            return resp
        request["kvcm_principal"], request["kvcm_tenant"] = principal, tenant
        return await handler(request)

    # -- lifecycle ------------------------------------------------------------------------

    def _manager_client(self, token: str, token_file: str) -> kvcm_aio.Client:
        c = self.cfg
        client = kvcm_aio.Client(
            c.manager_address, insecure=c.insecure, tls_ca_file=c.tls_ca_file or None,
            tls_cert_file=c.tls_cert_file or None, tls_key_file=c.tls_key_file or None,
            token=token or None,
            token_file=token_file or None, default_deadline_ms=c.route_deadline_ms,
            max_attempts=2)
        self._clients.append(client)
        return client

    async def _start(self, app: web.Application) -> None:
        c = self.cfg
        guard = ImbalanceGuard(c.imbalance_factor, c.imbalance_margin)
        if c.policy == "kv-aware":
            client = self._manager_client(c.token, c.token_file)
            register = (self._manager_client("", c.register_token_file)
                        if c.register_token_file else None)
            self.index = ManagerIndex(
                client, c.namespace.namespace, c.namespace.model_spec(),
                block_size=c.namespace.block_size, prefill_tokens_per_s=c.prefill_tokens_per_s,
                route_deadline_ms=c.route_deadline_ms, register_client=register)
            await self.index.register()
        index: Optional[PrefixIndex] = self.index
        if index is not None and c.engine_agents:
            index = AgentMappedIndex(index, c.engine_agents,
                                     prefill_tokens_per_s=c.prefill_tokens_per_s)
        first = [e.id for e in (c.prefill_engines if c.pd else c.engines)]
        policy = make_policy(c.policy, first, page_size=c.namespace.page_tokens,
                             block_size=c.namespace.block_size, guard=guard, index=index,
                             hash_prefix_pages=c.hash_prefix_pages)
        if c.pd:
            self.prefill_router = Router(policy, self.loads, self.metrics, first)
            decode = DecodePolicy(c.engine_agents, block_size=c.namespace.block_size,
                                  guard=guard)
            self.router = Router(decode, self.loads, self.metrics,
                                 [e.id for e in c.decode_engines])
        else:
            self.router = Router(policy, self.loads, self.metrics)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=c.upstream_timeout_s, sock_connect=5.0),
            auto_decompress=False)
        host, _ = c.listen_host_port
        if self.auth is None and not is_loopback_host(host):
            log.warning("*** kvcm-router listens on %s without tokens_file: anyone who "
                        "reaches it may send requests ***", c.listen_address)
        log.info("kvcm-router on http://%s: policy %s, %s", c.listen_address, c.policy,
                 "; ".join(f"{what} " + ", ".join(f"{e.id}={e.url}" for e in engines)
                           for what, engines in (("engines", c.engines),
                                                 ("prefill engines", c.prefill_engines),
                                                 ("decode engines", c.decode_engines))
                           if engines))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        for client in self._clients:
            await client.close()

    # -- proxy ----------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    def _routing_request(self, body: Any, chat: bool) -> RoutingRequest:
        if not isinstance(body, dict):
            raise TokenizerError("body: must be a JSON object")
        tokens = prompt_tokens(self.tokenizer, body, chat)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise TokenizerError("cache_salt: must be a string")
        model = body.get("model")
        lora = model if isinstance(model, str) and model in self.cfg.lora_adapters else None
        hashable = not (chat and has_non_text_parts(body.get("messages")))
        return RoutingRequest(tokens, lora_name=lora, cache_salt=salt or None,
                              hashable=hashable)

    async def _proxy(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        assert self.router is not None and self._session is not None
        raw = await request.read()
        try:
            body = json.loads(raw)
            routing = self._routing_request(body, chat)
        except ValueError as e:  # TokenizerError, or JSON that does not parse
            message = str(e) if isinstance(e, TokenizerError) else f"body: not JSON: {e}"
            return error_response(400, message, "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        # The tenant is the token's: a client's own claim never reaches an engine. The
        # client's token is the router's business, not the engine's.
        headers = {k: v for k, v in headers.items() if k.lower() != TENANT_HEADER}
        if self.auth is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            if request.get("kvcm_tenant"):
                headers[TENANT_HEADER] = request["kvcm_tenant"]
        # P/D: a prompt without a whole block before its last token has nothing to hand over.
        if self.prefill_router is not None and cacheable_tokens(
                len(routing.tokens), self.cfg.namespace.block_size) > 0:
            kv_agent = await self._prefill(body, chat, path, routing, headers)
            routing = dataclasses.replace(routing, kv_agent=kv_agent)
        routed = await self.router.route(routing, endpoint=path)
        ticket = routed.ticket
        engine = self.engines[ticket.engine_id]
        try:
            return await self._forward(request, engine.url + path, raw, headers, ticket)
        except _TooLarge:
            self.router.failed(ticket, "too-large", engine_down=False)
            return error_response(
                502, f"engine {engine.id} ({engine.url}) answered more than "
                f"max_response_bytes = {self.cfg.max_response_bytes} bytes; the answer was "
                "cut", "upstream_too_large", engine.id)
        except asyncio.TimeoutError:
            down = self.router.failed(ticket, "timeout", engine_down=True)
            return error_response(
                504, f"engine {engine.id} ({engine.url}) did not answer within "
                f"{self.cfg.upstream_timeout_s:g} s; avoided for {down:g} s",
                "upstream_timeout", engine.id)
        except aiohttp.ClientConnectorError as e:
            down = self.router.failed(ticket, "connect", engine_down=True)
            return error_response(
                502, f"engine {engine.id} ({engine.url}) is unreachable: {e.os_error}; "
                f"avoided for {down:g} s", "upstream_unavailable", engine.id)
        except (aiohttp.ClientError, ConnectionError) as e:
            down = self.router.failed(ticket, "disconnect", engine_down=True)
            return error_response(
                502, f"engine {engine.id} ({engine.url}) failed mid-answer: "
                f"{type(e).__name__}: {e}; avoided for {down:g} s", "upstream_unavailable",
                engine.id)
        finally:
            if ticket.open:  # the client went away, or the handler was cancelled
                self.router.abandon(ticket)

    async def _prefill(self, body: Dict[str, Any], chat: bool, path: str,
                       routing: RoutingRequest, headers: Dict[str, str]) -> Optional[str]:
        """P/D: the request with one output token on a prefill engine, awaited whole (its
        connector stores the prompt's pages before the engine answers). Returns the agent
        that now holds them, or None when the prefill failed (counted; the decode engine
        then computes the prompt itself)."""
        assert self.prefill_router is not None and self._session is not None
        routed = await self.prefill_router.route(routing, endpoint=path)
        ticket = routed.ticket
        engine = self.engines[ticket.engine_id]
        cause = ""
        try:
            async with self._session.post(engine.url + path, json=prefill_body(body, chat),
                                          headers=headers, allow_redirects=False) as up:
                data = await read_capped(up, self.cfg.max_response_bytes)
                if 300 <= up.status < 400:
                    cause = "redirect"
                    self.prefill_router.failed(ticket, cause, engine_down=False)
                    log.warning("prefill engine %s: HTTP %d redirect, not followed",
                                engine.id, up.status)
                elif up.status < 400:
                    cached = None
                    try:
                        cached = cached_tokens_of(json.loads(data).get("usage"))
                    except (ValueError, AttributeError):
                        pass
                    self.prefill_router.finish(ticket, cached)
                    return agent_of(self.cfg.engine_agents, engine.id)
                else:
                    cause = str(up.status)
                    self.prefill_router.failed(ticket, cause, engine_down=False)
                    log.warning("prefill engine %s: HTTP %d: %s", engine.id, up.status,
                                data[:200].decode(errors="replace"))
        except _TooLarge:
            cause = "too-large"
            self.prefill_router.failed(ticket, cause, engine_down=False)
            log.warning("prefill engine %s: answer over max_response_bytes = %d, cut",
                        engine.id, self.cfg.max_response_bytes)
        except asyncio.TimeoutError:
            cause = "timeout"
            self.prefill_router.failed(ticket, cause, engine_down=True)
        except (aiohttp.ClientError, ConnectionError) as e:
            cause = "connect" if isinstance(e, aiohttp.ClientConnectorError) else "disconnect"
            self.prefill_router.failed(ticket, cause, engine_down=True)
            log.warning("prefill engine %s (%s): %s: %s", engine.id, engine.url,
                        type(e).__name__, e)
        finally:
            if ticket.open:  # the handler was cancelled
                self.prefill_router.abandon(ticket)
        self.metrics.pd_prefill_fallbacks.labels(cause).inc()
        return None

    async def _forward(self, request: web.Request, url: str, raw: bytes,
                       headers: Dict[str, str], ticket: Ticket) -> web.StreamResponse:
        assert self.router is not None and self._session is not None
        engine_id = ticket.engine_id
        async with self._session.post(url, data=raw, headers=headers,
                                      allow_redirects=False) as up:
            content_type = up.headers.get("Content-Type", "application/json")
            if 300 <= up.status < 400:
                # Never followed: the engine does not choose where the router's requests go.
                self.router.failed(ticket, "redirect", engine_down=False)
                return error_response(
                    502, f"engine {engine_id} answered HTTP {up.status} (a redirect), which "
                    "the router does not follow", "upstream_redirect", engine_id)
            if up.status >= 400:
                data = await read_capped(up, self.cfg.max_response_bytes)
                self.router.failed(ticket, str(up.status), engine_down=False)
                return web.Response(body=data, status=up.status,
                                    headers={"Content-Type": content_type,
                                             ENGINE_HEADER: engine_id})
            if not content_type.startswith("text/event-stream"):
                data = await read_capped(up, self.cfg.max_response_bytes)
                cached = None
                try:
                    cached = cached_tokens_of(json.loads(data).get("usage"))
                except (ValueError, AttributeError):
                    pass
                self.router.finish(ticket, cached)
                return web.Response(body=data, status=up.status,
                                    headers={"Content-Type": content_type,
                                             ENGINE_HEADER: engine_id})
            resp = web.StreamResponse(status=up.status, headers={
                "Content-Type": content_type, "Cache-Control": "no-cache",
                ENGINE_HEADER: engine_id})
            await resp.prepare(request)
            usage = _SseUsage()
            chunks = up.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
                    # The status is sent: all that is left is to cut the stream short.
                    code = "timeout" if isinstance(e, asyncio.TimeoutError) else "disconnect"
                    self.router.failed(ticket, code, engine_down=True)
                    log.warning("engine %s: stream cut: %s", engine_id, e)
                    return resp
                self.router.prefill_done(ticket)  # the first chunk: prefill is over
                usage.feed(chunk)
                try:
                    await resp.write(chunk)
                except ConnectionError:  # the client went away: not the engine's fault
                    self.router.abandon(ticket)
                    return resp
            await resp.write_eof()
            self.router.finish(ticket, usage.cached_tokens)
            return resp

    # -- the rest -------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        merged: Dict[str, Any] = {}
        errors = []
        for engine_id in self.loads.available():
            engine = self.engines[engine_id]
            try:
                async with self._session.get(engine.url + "/v1/models",
                                             timeout=aiohttp.ClientTimeout(total=5),
                                             allow_redirects=False) as r:
                    if r.status != 200:
                        errors.append(f"{engine_id}: HTTP {r.status}")
                        continue
                    listed = json.loads(await read_capped(r, self.cfg.max_response_bytes))
                    for model in (listed.get("data", []) if isinstance(listed, dict) else []):
                        if isinstance(model, dict) and "id" in model:
                            merged.setdefault(model["id"], model)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, _TooLarge) as e:
                errors.append(f"{engine_id}: {type(e).__name__}")
        if not merged and errors:
            return error_response(502, "no engine listed its models: " + "; ".join(errors),
                                  "upstream_unavailable")
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def _health(self, request: web.Request) -> web.Response:
        up = {e: self.loads.is_up(e) for e in self.engines}
        body: Dict[str, Any] = {"status": "ok" if any(up.values()) else "no-engine",
                                "policy": self.cfg.policy, "pd": self.cfg.pd, "engines": up}
        if self.index is not None:
            body["manager_key"] = self.index.has_key
        return web.json_response(body, status=200 if any(up.values()) else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


def main(argv: Optional[List[str]] = None, prog: str = "kvcm-router") -> int:
    try:
        cfg = load_config(argv, prog)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def make_app() -> web.Application:
        return RouterServer(cfg).app

    host, port = cfg.listen_host_port
    try:
        web.run_app(make_app(), host=host, port=port, print=None)
    except TokenizerError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
