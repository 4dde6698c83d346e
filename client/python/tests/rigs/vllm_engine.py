"""A real vLLM OpenAI server (CPU build, scripts/vllm_env.sh) serving the tiny Llama of
rigs.tiny_llama on loopback ports, with KV events over ZeroMQ, for tests:

    with VllmEngine(workdir, num_blocks=64) as engine:      # waits for /health
        body = engine.complete([1, 2, 3] * 30)              # prompt as token ids
        engine.cached_tokens([1, 2, 3] * 30)                # usage.prompt_tokens_details
        engine.reset_prefix_cache()
        engine.pub_endpoint, engine.replay_endpoint         # where a bridge connects

The server runs from the vLLM environment's python ($KVCM_VLLM_PYTHON, or `python`), in its
own process group; its output goes to workdir/vllm-<port>.log. HTTP is urllib: this module
needs only the standard library (and rigs.manager for ports).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rigs import tiny_llama
from rigs.manager import free_port

MODEL_NAME = "tiny-llama"
# CPU attention needs block sizes that are multiples of 32.
BLOCK_SIZE = 32
# KV bytes of one block of the tiny model: layers x (K, V) x kv heads x head_dim x bf16 x tokens.
BLOCK_BYTES = 2 * 2 * 2 * 64 * 2 * BLOCK_SIZE


def vllm_python(python: str | None = None) -> str:
    """The vLLM environment's interpreter: `python`, else $KVCM_VLLM_PYTHON; '' when neither."""
    return python or os.environ.get("KVCM_VLLM_PYTHON", "")


class VllmEngine:
    """One vLLM server process. `num_blocks`: KV cache blocks (of BLOCK_SIZE tokens) for
    eviction tests; None leaves vLLM a 1 GiB cache. Not thread-safe."""

    def __init__(self, workdir: str | os.PathLike, *, python: str | None = None,
                 model_dir: str | os.PathLike | None = None, num_blocks: int | None = None,
                 topic: str = "kv", buffer_steps: int = 10_000, max_model_len: int = 512,
                 extra_args: tuple[str, ...] = (), start_timeout_s: float = 180.0,
                 extra_env: dict[str, str] | None = None, block_size: int = BLOCK_SIZE,
                 block_bytes: int = BLOCK_BYTES):
        self.python = vllm_python(python)
        if not self.python:
            raise RuntimeError("no vLLM python: set $KVCM_VLLM_PYTHON (scripts/vllm_env.sh)")
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model_dir = Path(model_dir) if model_dir else tiny_llama.write(self.dir / "model")
        self.num_blocks, self.topic, self.buffer_steps = num_blocks, topic, buffer_steps
        # Another model (rigs.tiny_deepseek) passes its own block size and bytes.
        self.block_size, self.block_bytes = block_size, block_bytes
        if num_blocks is not None:  # vLLM refuses a cache that cannot hold one longest request
            max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
        self.max_model_len, self.extra_args = max_model_len, extra_args
        self.extra_env = dict(extra_env or {})  # e.g. PYTHONPATH for a KV connector module
        self.start_timeout_s = start_timeout_s
        self.port, self.pub_port, self.replay_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self._launched = 0.0
        self.log_path = self.dir / f"vllm-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pub_endpoint(self) -> str:
        """The PUB endpoint as a subscriber connects to it (vLLM binds tcp://*)."""
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def kv_events_config(self) -> dict[str, Any]:
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.pub_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}",
                "buffer_steps": self.buffer_steps, "topic": self.topic}

    def args(self) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--model", str(self.model_dir), "--served-model-name", MODEL_NAME,
                "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(self.kv_events_config())]
        if self.num_blocks is not None:
            args += ["--kv-cache-memory-bytes", str(self.num_blocks * self.block_bytes)]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
                   VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.num_blocks is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
        env.update(self.extra_env)
        return env

    def start(self) -> "VllmEngine":
        """Starts the server and waits (at most start_timeout_s) until /health answers."""
        return self.launch().wait_healthy()

    def launch(self) -> "VllmEngine":
        """Starts the server without waiting (start several, then wait_healthy() each)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env(), start_new_session=True)
        self._launched = time.monotonic()
        return self

    def wait_healthy(self) -> "VllmEngine":
        """Until /health answers, at most start_timeout_s after launch(); RuntimeError with
        the log's tail if the server exits or stays unhealthy (it is stopped then)."""
        assert self.proc is not None, "launch() first"
        deadline = self._launched + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"vLLM exited with {code}:\n" + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM not healthy after {self.start_timeout_s:.0f} s:\n"
                                   + self.log_tail())
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM to the process group (the API server and its engine-core child), SIGKILL
        after 15 s; then SIGKILL to whatever of the group is left."""
        if self.proc is None:
            return
        group = self.proc.pid
        try:
            if self.proc.poll() is None:
                os.killpg(group, signal.SIGTERM)
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> "VllmEngine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- HTTP ---------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None,
             timeout_s: float = 60.0) -> Any:
        """POSTs JSON; the decoded answer (None when empty). HTTPError on a non-2xx status."""
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else None

    def complete(self, tokens: list[int], *, max_tokens: int = 1,
                 cache_salt: str | None = None, logprobs: int | None = None) -> dict[str, Any]:
        """/v1/completions of a prompt given as token ids (greedy)."""
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": tokens,
                                "max_tokens": max_tokens, "temperature": 0.0}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return self.post("/v1/completions", body)

    def stream(self, tokens: list[int], *, max_tokens: int, timeout_s: float = 120.0,
               on_chunk: Any = None) -> list[tuple[float, str]]:
        """/v1/completions streamed (greedy, ignoring EOS): (time.monotonic() on arrival,
        text) of each chunk, in order. on_chunk(count) is called after each."""
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "ignore_eos": True}
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[len(b"data: "):])["choices"][0]
                chunks.append((time.monotonic(), choice.get("text", "")))
                if on_chunk is not None:
                    on_chunk(len(chunks))
        return chunks

    def cached_tokens(self, tokens: list[int], *, cache_salt: str | None = None) -> int:
        """Sends the prompt (max_tokens 1): the prompt tokens vLLM found in its prefix cache.
        This request caches the prompt's blocks itself, and may evict others."""
        return cached_tokens_of(self.complete(tokens, cache_salt=cache_salt))

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")


def cached_tokens_of(body: dict[str, Any]) -> int:
    """usage.prompt_tokens_details.cached_tokens of an OpenAI answer (0 when absent)."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
