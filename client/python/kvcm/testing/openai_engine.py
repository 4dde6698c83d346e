"""A fake OpenAI-compatible inference engine with a vLLM-like prefix cache, for tests and
demos of kvcm-router.

It answers POST /v1/completions and /v1/chat/completions (plain and `stream: true` SSE)
deterministically, tokenizing with the router's test tokenizers (kvcm.router.tokenizer,
same chat template), and keeps its prefix cache in a `FakeVllmEngine` that publishes vLLM's
KV events over ZMQ exactly as vLLM does, so kvcm-vllm-bridge can mirror it. Answers report
`usage.prompt_tokens_details.cached_tokens` as vLLM does, and /metrics exports the cache's
true hits as vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` counters.

Service time: a request waits `prefill_ms_per_token` per uncached prompt token (serialized
per engine, as a prefill queue), then `decode_ms_per_token` per output token (concurrent).
Both default to 0.

    python -m kvcm.testing.openai_engine --port 8101 --engine-id vllm-0 \\
        --kv-events-endpoint 'tcp://*:5557' --replay-endpoint 'tcp://*:5558'
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from typing import Any, Dict, List, Optional

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client import generate_latest

from kvcm.router.tokenizer import Tokenizer, TokenizerError, load_tokenizer, prompt_tokens
from kvcm.testing.fake_vllm import FakeVllmEngine, FakeVllmPublisher

log = logging.getLogger("kvcm.testing.openai_engine")

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
          "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    # vLLM's ErrorResponse shape.
    return web.json_response({"object": "error", "message": message, "type": kind,
                              "param": None, "code": status}, status=status)


def output_words(prompt: List[int], n: int) -> List[str]:
    """`n` words determined by the prompt: the answer of this engine (and of any other)."""
    seed = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    out = []
    for i in range(n):
        h = hashlib.blake2b(seed + i.to_bytes(4, "little"), digest_size=1).digest()[0]
        out.append(_WORDS[h % len(_WORDS)])
    return out


class OpenAIEngine:
    """One fake engine. Build it inside the event loop that serves it. Not thread-safe."""

    def __init__(self, engine_id: str, *, model: str = "fake-model",
                 tokenizer: Optional[Tokenizer] = None, block_size: int = 16,
                 num_blocks: int = 1024, kv_events_endpoint: Optional[str] = None,
                 replay_endpoint: Optional[str] = None, topic: str = "",
                 lora_adapters: tuple[str, ...] = (), prefill_ms_per_token: float = 0.0,
                 decode_ms_per_token: float = 0.0, max_tokens_default: int = 16) -> None:
        self.engine_id = engine_id
        self.model = model
        self.tokenizer = tokenizer or load_tokenizer("words")
        self.lora_adapters = tuple(lora_adapters)
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_ms_per_token = decode_ms_per_token
        self.max_tokens_default = max_tokens_default
        self.publisher = (FakeVllmPublisher(kv_events_endpoint, replay_endpoint, topic=topic)
                          if kv_events_endpoint else None)
        self.cache = FakeVllmEngine(block_size, num_blocks, self.publisher)
        self._prefill_lock = asyncio.Lock()
        self.requests = 0
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._queries = Counter("vllm:prefix_cache_queries", "Prompt tokens queried against "
                                "the prefix cache", labels, registry=self.registry)
        self._hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix "
                             "cache", labels, registry=self.registry)
        self._prompt = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels,
                               registry=self.registry)
        self._running = Gauge("vllm:num_requests_running", "Requests in the engine", labels,
                              registry=self.registry)
        self._labels = (model, engine_id)
        for m in (self._queries, self._hits, self._prompt, self._running):
            m.labels(*self._labels)
        self.app = web.Application()
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self.app.on_cleanup.append(self._cleanup)

    def _sample(self, name: str) -> int:
        labels = {"model_name": self._labels[0], "engine": self._labels[1]}
        return int(self.registry.get_sample_value(name, labels) or 0)

    @property
    def hits(self) -> int:
        """Prompt tokens served from the prefix cache so far."""
        return self._sample("vllm:prefix_cache_hits_total")

    @property
    def queries(self) -> int:
        return self._sample("vllm:prefix_cache_queries_total")

    async def _cleanup(self, app: web.Application) -> None:
        self.close()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None

    # -- requests -------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise TokenizerError("body: must be a JSON object")
            tokens = prompt_tokens(self.tokenizer, body, chat)
        except ValueError as e:
            return _error(400, str(e))
        model = body.get("model", self.model)
        if model != self.model and model not in self.lora_adapters:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        lora = model if model in self.lora_adapters else None
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return _error(400, "cache_salt: must be a string")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens",
                                                     self.max_tokens_default))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens: must be a positive integer")
        self.requests += 1
        self._running.labels(*self._labels).inc()
        try:
            async with self._prefill_lock:  # one prefill at a time, as a prefill queue
                try:
                    cached = self.cache.process(tokens, lora_name=lora, cache_salt=salt or None)
                except RuntimeError as e:  # more blocks than the cache has
                    return _error(400, f"prompt of {len(tokens)} tokens does not fit the KV "
                                       f"cache: {e}")
                self._queries.labels(*self._labels).inc(len(tokens))
                self._hits.labels(*self._labels).inc(cached)
                self._prompt.labels(*self._labels).inc(len(tokens))
                await asyncio.sleep((len(tokens) - cached) * self.prefill_ms_per_token / 1000)
            words = output_words(tokens, max_tokens)
            usage = {"prompt_tokens": len(tokens), "completion_tokens": len(words),
                     "total_tokens": len(tokens) + len(words),
                     "prompt_tokens_details": {"cached_tokens": cached}}
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.engine_id}-{self.requests}"
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, rid, model, chat, words, usage,
                                          include_usage)
            await asyncio.sleep(len(words) * self.decode_ms_per_token / 1000)
            return web.json_response(self._answer(rid, model, chat, words, usage))
        finally:
            self._running.labels(*self._labels).dec()

    def _answer(self, rid: str, model: str, chat: bool, words: List[str],
                usage: Dict[str, Any]) -> Dict[str, Any]:
        text = " ".join(words)
        created = int(time.time())
        if chat:
            choice: Dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice], "usage": usage, "kvcm_engine": self.engine_id}

    async def _stream(self, request: web.Request, rid: str, model: str, chat: bool,
                      words: List[str], usage: Dict[str, Any],
                      include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices: List[Dict[str, Any]], extra: Optional[Dict] = None) -> None:
            event: Dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                     "model": model, "choices": choices}
            if extra:
                event.update(extra)
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        for i, word in enumerate(words):
            last = i == len(words) - 1
            piece = word if i == 0 else " " + word
            if chat:
                delta: Dict[str, Any] = {"content": piece}
                if i == 0:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None,
                          "finish_reason": "length" if last else None}
            await send([choice])
            if not last:
                await asyncio.sleep(self.decode_ms_per_token / 1000)
        if include_usage:
            await send([], {"usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- the rest -------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [{"id": self.model, "object": "model", "created": created,
                 "owned_by": "kvcm-fake", "root": self.model, "parent": None}]
        data += [{"id": a, "object": "model", "created": created, "owned_by": "kvcm-fake",
                  "root": a, "parent": self.model} for a in self.lora_adapters]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Parser(argparse.ArgumentParser):
    """Each --a-b option (vLLM's spelling) also answers to --a_b (kvcm's)."""

    def add_argument(self, *names: Any, **kw: Any) -> Any:
        more = ["--" + n[2:].replace("-", "_") for n in names
                if isinstance(n, str) and n.startswith("--") and "-" in n[2:]]
        return super().add_argument(*names, *more, **kw)


def main(argv: Optional[List[str]] = None) -> int:
    p = _Parser(prog="python -m kvcm.testing.openai_engine",
                                description="A fake OpenAI-compatible engine with a vLLM-like "
                                            "prefix cache publishing vLLM KV events.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--tokenizer", default="words", help="'words' or 'bytes' (the router's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--kv-events-endpoint", help="ZMQ PUB endpoint, e.g. tcp://*:5557")
    p.add_argument("--replay-endpoint", help="ZMQ ROUTER replay endpoint, e.g. tcp://*:5558")
    p.add_argument("--topic", default="")
    p.add_argument("--lora-adapter", action="append", default=[])
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    p.add_argument("--decode-ms-per-token", type=float, default=0.0)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def make_app() -> web.Application:
        engine = OpenAIEngine(
            args.engine_id, model=args.model, tokenizer=load_tokenizer(args.tokenizer),
            block_size=args.block_size, num_blocks=args.num_blocks,
            kv_events_endpoint=args.kv_events_endpoint, replay_endpoint=args.replay_endpoint,
            topic=args.topic, lora_adapters=tuple(args.lora_adapter),
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_ms_per_token=args.decode_ms_per_token)
        log.info("fake engine %s on http://%s:%d (block size %d, %d blocks, events %s)",
                 args.engine_id, args.host, args.port, args.block_size, args.num_blocks,
                 args.kv_events_endpoint or "off")
        return engine.app

    web.run_app(make_app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
