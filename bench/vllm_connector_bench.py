#!/usr/bin/env python3
"""Time to first token of a real vLLM engine (CPU build) with kvcm as its KV connector: a
long prompt recomputed vs. loaded from the local kvcm-agent, the connector's load and store
copy rates against a plain memcpy of the same bytes, and the scheduler-side cost of one
request (hash + Route with pin + Release), all measured in one run.

    build/test/pyenv/bin/python bench/vllm_connector_bench.py \\
        --manager_bin build/test/server/kvcm-manager --agent_bin build/test/gpu/agent/kvcm-agent \\
        --vllm_python build/test/vllm-venv/bin/python [--transport grpc|local] [--smoke]

The model is client/python/tests/rigs/tiny_llama.py's Llama with a larger shape (--layers, --hidden, ...)
and vLLM's dummy weights (timing does not depend on the values): big enough that prefill
dominates a long prompt's TTFT on this CPU. Each sample sends a fresh prompt twice with
max_tokens 1 (the request's latency is its TTFT): first a miss (vLLM computes the prompt,
the connector stores its whole blocks), then, after /reset_prefix_cache empties vLLM's own
cache, a hit (the connector loads every whole block from the agent; vLLM computes the last
partial block's tokens). "tail" is a prompt of just those uncached tokens, computed cold.
The prediction the issue sets: hit TTFT <= 1.2 x (loaded bytes / memcpy rate + one Route
+ the tail's prefill).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kvcm

# The rigs are the repository's test helpers, not part of the installed kvcm package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client" / "python" / "tests"))
from rigs import tiny_llama  # noqa: E402
from rigs.manager import ManagerProcess, free_port  # noqa: E402
from rigs.vllm_engine import MODEL_NAME, VllmEngine, cached_tokens_of  # noqa: E402

BLOCK = 32  # vLLM's CPU block size (multiple of 32)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manager_bin", required=True)
    p.add_argument("--agent_bin", required=True)
    p.add_argument("--vllm_python", required=True)
    p.add_argument("--transport", choices=("grpc", "local"), default="grpc")
    p.add_argument("--smoke", action="store_true", help="tiny model, one short sample")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--prompt_tokens", type=int, default=2000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--workdir", default="")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.prompt_tokens = 1, 200
        args.layers, args.hidden, args.intermediate = 2, 256, 512
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
    return args


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def memcpy_rate(nbytes: int, hot: bool, repeats: int = 16) -> float:
    """Bytes per second of numpy copies of `nbytes` (median). hot: the same two buffers
    every time (in cache when they fit); else each copy between buffers not touched since
    the round before, out of 8 pairs (as a load finds the agent's and vLLM's blocks)."""
    pairs = 1 if hot else 8
    rng = np.random.default_rng(0)
    bufs = [(rng.integers(0, 255, nbytes, dtype=np.uint8), np.ones(nbytes, dtype=np.uint8))
            for _ in range(pairs)]
    times = []
    for i in range(repeats):
        src, dst = bufs[i % pairs]
        _, t = timed(lambda: np.copyto(dst, src))
        times.append(t)
    return nbytes / statistics.median(times)


def log_rates(log: str, pattern: str) -> list[float]:
    """Bytes per second of every connector log line matching `pattern` (bytes, ms)."""
    return [int(b) / (float(ms) / 1e3) for b, ms in re.findall(pattern, log) if float(ms) > 0]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvcm-connector-bench-"))
    shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    model_dir = tiny_llama.write(workdir / "model", **shape)
    block_bytes = args.layers * 2 * args.kv_heads * args.head_dim * 2 * BLOCK
    pages = (args.prompt_tokens - 1) // BLOCK
    tail_tokens = args.prompt_tokens - pages * BLOCK
    ns = kvcm.Namespace("bench", MODEL_NAME)

    manager = ManagerProcess(args.manager_bin, workdir / "manager")
    manager.start()
    agent_port = free_port()
    socket_path = workdir / "agent.sock"
    agent_args = [args.agent_bin, "--insecure", "--agent_id=gpu0",
                  f"--manager_address={manager.address}",
                  f"--listen_address=127.0.0.1:{agent_port}", "--use_device=false",
                  "--model=", "--attention=gqa", f"--num_layers={args.layers}",
                  f"--num_heads={args.heads}", f"--num_kv_heads={args.kv_heads}",
                  f"--head_dim={args.head_dim}", "--kv_dtype=bf16",
                  f"--page_size_tokens={BLOCK}",
                  f"--capacity_bytes={block_bytes * (pages + 1) * (args.samples + 1)}",
                  "--heartbeat_interval_ms=200"]
    if args.transport == "local":
        agent_args.append(f"--local_socket={socket_path}")
    agent_log = open(workdir / "agent.log", "wb")
    agent = subprocess.Popen(agent_args, stdout=agent_log, stderr=subprocess.STDOUT)
    client = kvcm.Client(manager.address, insecure=True)
    engine = None
    try:
        deadline = time.monotonic() + 15
        while not any(a.agent_id == "gpu0" and a.alive for a in client.stats().agents):
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError("the agent did not register: "
                                   + (workdir / "agent.log").read_text())
            time.sleep(0.1)
        pythonpath = workdir / "pythonpath"
        pythonpath.mkdir(exist_ok=True)
        if not (pythonpath / "kvcm").exists():
            (pythonpath / "kvcm").symlink_to(Path(kvcm.__file__).parent)
        extra = {"manager_address": manager.address, "agent_id": "gpu0",
                 "agent_address": f"127.0.0.1:{agent_port}", "tenant": ns.tenant,
                 "model": MODEL_NAME}
        if args.transport == "local":
            extra["local_socket"] = str(socket_path)
        config = {"kv_connector": "KvcmConnector",
                  "kv_connector_module_path": "kvcm.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": extra}
        engine = VllmEngine(workdir / "engine", python=args.vllm_python,
                            model_dir=model_dir, max_model_len=args.prompt_tokens + 64,
                            extra_args=("--kv-transfer-config", json.dumps(config)),
                            extra_env={"PYTHONPATH": str(pythonpath)}, start_timeout_s=600)
        engine.start()
        # The connector registered the namespace; this client needs its hash key too.
        client.register_model(ns, kvcm.ModelSpec(
            attention=kvcm.AttentionKind.GQA, num_layers=args.layers, num_heads=args.heads,
            num_kv_heads=args.kv_heads, head_dim=args.head_dim, page_size_tokens=BLOCK))
        rng = np.random.default_rng(1)

        def prompt() -> list[int]:
            return [int(t) for t in rng.integers(0, 1000, args.prompt_tokens)]

        # Warm-up: the first requests pay one-off costs (compilation, allocations).
        engine.complete(prompt())
        engine.complete(prompt()[:tail_tokens])
        miss, hit, tail = [], [], []
        for _ in range(args.samples):
            p = prompt()
            body, t = timed(lambda: engine.complete(p))
            assert cached_tokens_of(body) == 0, body
            miss.append(t)
            deadline = time.monotonic() + 30
            while client.match(ns, p, requester_agent_id="gpu0", probe=True).local_pages < pages:
                if time.monotonic() > deadline:
                    raise RuntimeError("the miss was not stored:\n" + engine.log_tail())
                time.sleep(0.02)
            engine.reset_prefix_cache()
            body, t = timed(lambda: engine.complete(p))
            if cached_tokens_of(body) != pages * BLOCK:
                raise RuntimeError(f"hit loaded {cached_tokens_of(body)} of {pages * BLOCK} "
                                   "tokens:\n" + engine.log_tail())
            hit.append(t)
            engine.reset_prefix_cache()
            _, t = timed(lambda: engine.complete(prompt()[:tail_tokens]))
            tail.append(t)
        # The scheduler side of one request, as the connector runs it.
        p = prompt()
        engine.complete(p)
        time.sleep(0.5)
        sched = []
        for _ in range(50):
            def schedule() -> None:
                hashes = client.hash_prompt(ns, p[: pages * BLOCK])
                route = client.route(ns, page_hashes=hashes, candidates=["gpu0"], pin=True,
                                     lease_ttl_ms=60_000)
                if route.match.pin_id:
                    client.release(ns, route.match.pin_id)
            sched.append(timed(schedule)[1])
        log = engine.log_path.read_text(errors="replace")
    finally:
        client.close()
        if engine is not None:
            engine.stop()
        agent.terminate()
        agent.wait(10)
        manager.stop()

    loaded = pages * block_bytes
    copy = memcpy_rate(loaded, hot=False)
    copy_hot = memcpy_rate(loaded, hot=True)
    load_rates = log_rates(log, r"loaded \d+ blocks of \S+ \(\d+ fetched from other agents\): "
                                r"(\d+) bytes in ([\d.]+) ms")
    store_rates = log_rates(log, r"copied \d+ pages of \S+ to the agent: (\d+) bytes in "
                                 r"([\d.]+) ms")
    med = statistics.median
    sched_s = med(sched)
    predicted = loaded / copy + sched_s + med(tail)
    result = {
        "model": shape, "transport": args.transport, "prompt_tokens": args.prompt_tokens,
        "loaded_pages": pages, "loaded_bytes": loaded, "samples": args.samples,
        "ttft_miss_ms": 1e3 * med(miss), "ttft_hit_ms": 1e3 * med(hit),
        "ttft_tail_ms": 1e3 * med(tail), "speedup": med(miss) / med(hit),
        "memcpy_GBps": copy / 1e9, "memcpy_hot_GBps": copy_hot / 1e9,
        "load_GBps": med(load_rates) / 1e9 if load_rates else None,
        "store_GBps": med(store_rates) / 1e9 if store_rates else None,
        "load_vs_memcpy": med(load_rates) / copy if load_rates else None,
        "store_vs_memcpy": med(store_rates) / copy if store_rates else None,
        "scheduler_ms": 1e3 * sched_s, "predicted_hit_ms": 1e3 * predicted,
        "hit_vs_predicted": med(hit) / predicted,
    }
    for k, v in result.items():
        print(f"{k:18} {v:.3f}" if isinstance(v, float) else f"{k:18} {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
