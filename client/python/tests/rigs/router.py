"""Test helpers: fake OpenAI engines and a kvcm-router served in process on loopback ports,
and small HTTP and metrics readers."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List, Optional, Tuple

import aiohttp
from aiohttp import web

from conftest import free_port
from kvcm.router.config import EngineSpec, NamespaceConfig, RouterConfig
from kvcm.router.server import RouterServer
from kvcm.testing.openai_engine import OpenAIEngine


class Served:
    """An aiohttp application listening on 127.0.0.1:port until stop()."""

    def __init__(self, app: web.Application, port: int) -> None:
        self.app = app
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._runner = web.AppRunner(app)

    async def start(self) -> "Served":
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        """Stops listening (idempotent)."""
        if self._runner.server is not None:
            await self._runner.cleanup()


async def start_engine(engine_id: str, **kw: Any) -> Tuple[OpenAIEngine, Served]:
    engine = OpenAIEngine(engine_id, **kw)
    return engine, await Served(engine.app, free_port()).start()


async def start_router(engines: List[Tuple[str, str]], policy: str, **kw: Any
                       ) -> Tuple[RouterServer, Served]:
    ns = kw.pop("namespace", None) or NamespaceConfig(tenant="acme", model="fake-model",
                                                      preset="llama-3-8b", block_size=16)
    cfg = RouterConfig(policy=policy, tokenizer="words",
                       engines=[EngineSpec(i, u) for i, u in engines], namespace=ns,
                       engine_down_s=30.0, **kw)
    port = free_port()
    cfg.listen_address = f"127.0.0.1:{port}"
    server = RouterServer(cfg)
    return server, await Served(server.app, port).start()


async def post(session: aiohttp.ClientSession, url: str, body: Dict[str, Any]
               ) -> Tuple[int, Dict[str, Any], Optional[str]]:
    """Status, JSON body and x-kvcm-engine of a POST."""
    async with session.post(url, json=body) as r:
        return r.status, json.loads(await r.read()), r.headers.get("x-kvcm-engine")


async def sse(session: aiohttp.ClientSession, url: str, body: Dict[str, Any]
              ) -> Tuple[int, List[Any], bytes]:
    """Status, the decoded data events ("[DONE]" as a string) and the raw bytes."""
    async with session.post(url, json=body) as r:
        raw = await r.read()
    events: List[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return r.status, events, raw


def sample(text: str, name: str, labels: Dict[str, str]) -> float:
    """A sample's value from Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as r:
        return await r.text()


async def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
