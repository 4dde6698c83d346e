#!/usr/bin/env python3
"""Replays a Mooncake trace through simulated vLLM engines behind each routing policy, in
one run, and reports prefix hit rate, load imbalance and time to first token per policy.

    build/pyenv/bin/python bench/router_replay.py --manager_bin build/test/server/kvcm-manager
    build/pyenv/bin/python bench/router_replay.py --smoke ...      # 300 requests (tests)

Every policy gets its own `--engines` engines (kvcm.testing.fake_vllm.FakeVllmEngine: vLLM's
block hashing and LRU eviction, `--capacity_blocks` blocks of `--block_size` tokens) and its
own kvcm.router.Router; requests arrive at the trace's timestamps in simulated time.
kv-aware's engines feed the manager's engine pools through the bridge's own path: their
vLLM KV events go through kvcm.engines' EngineMirror and PublishSession into
PublishEngineEvents (no Insert), and the router asks the manager's Route (probe) exactly as
kvcm-router does. The manager is published to after every request, before the next is
routed: an index with no lag.

Tokens: each trace hash id stands for 512 tokens, drawn deterministically from the id
(a partial last block takes the first input_length mod 512 of its id's tokens), so equal id
prefixes are equal token prefixes. Service model (docs/ROUTER.md, "Replay"): an engine
prefills one request at a time, FIFO, at --prefill_tokens_per_s (cached tokens are free),
and then decodes output_length tokens at --decode_ms_per_token each, concurrently with
everything else. The router's in-flight counts and queued prefill tokens follow that model.
The cache hit of a request is decided when it arrives (vLLM decides it when it schedules).

Hit rate = cached prompt tokens the engines reported / prompt tokens, over the requests
at or after --report_from (a fraction of the replayed span: the caches warm up before).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id
VOCAB = 32000


@dataclass(frozen=True)
class TraceRequest:
    index: int
    t_s: float
    input_length: int
    output_length: int
    hash_ids: Tuple[int, ...]


def read_trace(path: Path, limit: int) -> List[TraceRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit and i >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(i, r["timestamp"] / 1000.0, r["input_length"],
                                    r["output_length"], tuple(r["hash_ids"])))
    return out


def tokens_of(r: TraceRequest) -> List[int]:
    """input_length token ids: 512 per hash id, from a generator seeded by the id."""
    parts = []
    for i, h in enumerate(r.hash_ids):
        n = min(TRACE_BLOCK_TOKENS, r.input_length - i * TRACE_BLOCK_TOKENS)
        if n <= 0:
            break
        block = np.random.Generator(np.random.PCG64(h)).integers(0, VOCAB, TRACE_BLOCK_TOKENS,
                                                                 dtype=np.int32)
        parts.append(block[:n])
    return np.concatenate(parts).tolist() if parts else []


# -- one simulated engine ------------------------------------------------------------------


class SimEngine:
    """A FakeVllmEngine with a FIFO prefill queue; for kv-aware, its bridge path too."""

    def __init__(self, engine_id: str, block_size: int, capacity_blocks: int,
                 mirror: Any = None, session: Any = None) -> None:
        from kvcm.testing.fake_vllm import FakeVllmEngine

        self.id = engine_id
        self.cache = FakeVllmEngine(block_size, capacity_blocks)
        self.mirror = mirror
        self.session = session
        self.prefill_free_at = 0.0

    def process(self, tokens: List[int]) -> int:
        """Runs the request through the cache; returns the prompt tokens it hit. Its KV
        events go to the mirror (when there is one)."""
        cached = self.cache.process(tokens)
        events, self.cache.events = self.cache.events, []
        self.cache.meta.clear()  # per-block content kept for tests; only needed in process()
        if self.mirror is not None:
            self.mirror.apply_batch(events)
            self.session.add(self.mirror.take_changes())
        return cached


class Publisher:
    """Sends each kv-aware engine's session requests to the manager (the bridge's calls)."""

    def __init__(self, connection: Any, registration: Any, tenant: str, model: str) -> None:
        self.conn = connection
        self.reg = registration
        self.tenant, self.model = tenant, model
        self.requests = 0

    async def flush(self, engine: SimEngine) -> None:
        while True:
            request = engine.session.next_request(time.monotonic())
            if request is None:
                return
            result = await self.conn.publish(engine.id, self.tenant, self.model, self.reg,
                                             request, ttl_ms=600_000, token="")
            engine.session.on_sent(time.monotonic(), result.stored_pages, result.removed_pages)
            self.requests += 1
            if not request.changes:
                return


# -- one policy arm ------------------------------------------------------------------------


@dataclass
class ArmResult:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    expected_cached_tokens: int = 0
    per_engine: Dict[str, int] = field(default_factory=dict)
    ttft_s: List[float] = field(default_factory=list)
    reasons: Dict[str, int] = field(default_factory=dict)
    route_s: List[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        counts = list(self.per_engine.values())
        return max(counts) / statistics.mean(counts) if counts and sum(counts) else 0.0


class PooledReference:
    """One cache as large as all the engines together, seeing every request: the hit rate
    of routing that never duplicates a prefix and never evicts for imbalance (a reference,
    not a policy: no queue)."""

    def __init__(self, args: argparse.Namespace, report_from_s: float) -> None:
        self.engine = SimEngine("pooled", args.block_size, args.engines * args.capacity_blocks)
        self.report_from_s = report_from_s
        self.result = ArmResult(f"(one {args.engines * args.capacity_blocks}-block cache)")

    async def serve(self, r: TraceRequest, tokens: List[int]) -> None:
        cached = self.engine.process(tokens)
        if r.t_s >= self.report_from_s:
            self.result.requests += 1
            self.result.prompt_tokens += len(tokens)
            self.result.cached_tokens += cached


class Arm:
    def __init__(self, policy: str, engines: List[SimEngine], router: Any,
                 publisher: Optional[Publisher], args: argparse.Namespace,
                 report_from_s: float) -> None:
        self.policy = policy
        self.engines = {e.id: e for e in engines}
        self.router = router
        self.publisher = publisher
        self.args = args
        self.report_from_s = report_from_s
        self.result = ArmResult(policy, per_engine={e.id: 0 for e in engines})
        self._events: List[Tuple[float, int, str, Any]] = []  # (time, seq, kind, ticket)
        self._seq = 0

    def _advance(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            _, _, kind, ticket = heapq.heappop(self._events)
            if kind == "prefill":
                self.router.prefill_done(ticket)
            else:
                self.router.finish(ticket)

    async def serve(self, r: TraceRequest, tokens: List[int]) -> None:
        from kvcm.router import RoutingRequest

        self._advance(r.t_s)
        start = time.perf_counter()
        routed = await self.router.route(RoutingRequest(tokens))
        route_s = time.perf_counter() - start
        engine = self.engines[routed.decision.engine_id]
        cached = engine.process(tokens)
        if self.publisher is not None:
            for e in self.engines.values():  # the chosen one's changes, others' heartbeats
                await self.publisher.flush(e)
        a = self.args
        prefill_start = max(r.t_s, engine.prefill_free_at)
        prefill_end = prefill_start + (len(tokens) - cached) / a.prefill_tokens_per_s
        engine.prefill_free_at = prefill_end
        end = prefill_end + r.output_length * a.decode_ms_per_token / 1000.0
        for when, kind in ((prefill_end, "prefill"), (end, "end")):
            self._seq += 1
            heapq.heappush(self._events, (when, self._seq, kind, routed.ticket))
        if r.t_s >= self.report_from_s:
            res = self.result
            res.requests += 1
            res.prompt_tokens += len(tokens)
            res.cached_tokens += cached
            res.expected_cached_tokens += routed.decision.expected_cached_tokens
            res.per_engine[engine.id] += 1
            res.ttft_s.append(prefill_end - r.t_s)
            res.route_s.append(route_s)
            reason = routed.decision.reason
            res.reasons[reason] = res.reasons.get(reason, 0) + 1


# -- the manager ---------------------------------------------------------------------------


def find_manager_binary(given: str) -> str:
    for candidate in (given, os.environ.get("KVCM_MANAGER_BIN", ""),
                      str(REPO / "build/test/server/kvcm-manager"),
                      str(REPO / "build/h/server/kvcm-manager"), shutil.which("kvcm-manager")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("router_replay: no kvcm-manager binary (--manager_bin or "
                     "$KVCM_MANAGER_BIN), or give --manager HOST:PORT")


class ManagerProcess:
    """A plaintext kvcm-manager on a free loopback port, stopped on exit."""

    def __init__(self, binary: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="kvcm-replay-")
        secret = Path(self.dir) / "secret"
        secret.write_text(os.urandom(16).hex())
        self.log = open(Path(self.dir) / "manager.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--listen_address=127.0.0.1:{self.port}", "--metrics_address=",
             "--insecure", f"--hash_secret_file={secret}", "--shutdown_grace_ms=100"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"

    async def wait(self, timeout_s: float = 15.0) -> None:
        import grpc

        end = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self.address) as ch:
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit("router_replay: kvcm-manager exited: " +
                                     (Path(self.dir) / "manager.log").read_text()[-2000:])
                try:
                    await asyncio.wait_for(ch.channel_ready(), 0.2)
                    return
                except asyncio.TimeoutError:
                    if time.monotonic() > end:
                        raise SystemExit("router_replay: kvcm-manager did not listen") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- main ----------------------------------------------------------------------------------


def arm_guard(name: str, args: argparse.Namespace) -> Tuple[str, Any]:
    """An arm's policy and guard: POLICY, POLICY:noguard, or POLICY:guard=FACTOR/MARGIN."""
    from kvcm.router import POLICIES, ImbalanceGuard

    policy, _, variant = name.partition(":")
    if policy not in POLICIES:
        raise ValueError(f"{policy!r} is not one of {', '.join(POLICIES)}")
    if not variant:
        return policy, ImbalanceGuard(args.imbalance_factor, args.imbalance_margin)
    if variant == "noguard":
        return policy, ImbalanceGuard(factor=-1)
    if variant.startswith("guard="):
        factor, _, margin = variant[6:].partition("/")
        try:
            return policy, ImbalanceGuard(float(factor), int(margin))
        except ValueError:
            pass
    raise ValueError(f"{variant!r} is not noguard or guard=FACTOR/MARGIN")


async def build_arms(args: argparse.Namespace, address: str, report_from_s: float
                     ) -> Tuple[List[Arm], List[Any]]:
    import kvcm.aio
    from kvcm.router import LoadTracker, Router, make_policy
    from kvcm.router.manager_index import ManagerIndex
    from kvcm.types import ModelSpec, Namespace
    from kvcm.engines.manager import ManagerConnection
    from kvcm.engines.mirror import EngineMirror
    from kvcm.engines.session import PublishSession

    spec = ModelSpec.from_catalog("llama-3-8b", page_size_tokens=args.page_size)
    ns = Namespace("replay", "mooncake")
    arms, closers = [], []
    for arm, name in enumerate(args.policies):
        policy, guard = arm_guard(name, args)
        ids = [f"arm{arm}-{i}" for i in range(args.engines)]  # engine ids: no "/" or "="
        index = publisher = None
        engines: List[SimEngine] = []
        if policy == "kv-aware":
            conn = ManagerConnection(address, insecure=True, deadline_ms=30_000)
            reg = await conn.register(ns.tenant, ns.model, spec, token="")
            publisher = Publisher(conn, reg, ns.tenant, ns.model)
            for e in ids:
                session = PublishSession()
                mirror = EngineMirror(reg.hash_key, args.page_size, args.block_size)
                session.open(mirror.snapshot())
                engines.append(SimEngine(e, args.block_size, args.capacity_blocks, mirror,
                                         session))
                await publisher.flush(engines[-1])
            client = kvcm.aio.Client(address, insecure=True, default_deadline_ms=30_000)
            index = ManagerIndex(client, ns, spec, block_size=args.block_size,
                                 prefill_tokens_per_s=args.prefill_tokens_per_s,
                                 route_deadline_ms=30_000)
            if not await index.register():
                raise SystemExit("router_replay: RegisterModel failed")
            closers += [conn.close, client.close]
        else:
            engines = [SimEngine(e, args.block_size, args.capacity_blocks) for e in ids]
        policy_obj = make_policy(policy, ids, page_size=args.page_size,
                                 block_size=args.block_size, guard=guard, index=index)
        router = Router(policy_obj, LoadTracker(ids))
        arms.append(Arm(name, engines, router, publisher, args, report_from_s))
    return arms, closers


def percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(args: argparse.Namespace, arms: List[Any], trace: List[TraceRequest],
           report_from_s: float, wall_s: float) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    for arm in arms:
        r = arm.result
        if isinstance(arm, PooledReference):
            rows.append({"policy": r.policy, "reference": True, "requests": r.requests,
                         "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                         "hit_rate": r.hit_rate})
            continue
        rows.append({
            "policy": r.policy, "requests": r.requests, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "hit_rate": r.hit_rate,
            "expected_cached_tokens": r.expected_cached_tokens,
            "imbalance_max_over_mean": r.imbalance, "per_engine": r.per_engine,
            "ttft_mean_s": statistics.mean(r.ttft_s) if r.ttft_s else 0.0,
            "ttft_p50_s": percentile(r.ttft_s, 0.5), "ttft_p99_s": percentile(r.ttft_s, 0.99),
            "reasons": r.reasons,
            "route_p50_ms": percentile(r.route_s, 0.5) * 1e3})
    header = (f"router_replay: {len(trace)} requests of {args.trace.name}, "
              f"{args.engines} engines x {args.capacity_blocks} blocks of {args.block_size} "
              f"tokens, page {args.page_size}, prefill {args.prefill_tokens_per_s:g} tok/s, "
              f"decode {args.decode_ms_per_token:g} ms/token, guard factor "
              f"{args.imbalance_factor:g} margin {args.imbalance_margin}; reported: requests "
              f"from t >= {report_from_s:.0f} s ({rows[0]['requests']} requests); "
              f"{wall_s:.0f} s wall")
    print(header)
    print(f"{'policy':<24}{'hit rate':>9}{'max/mean':>10}{'TTFT mean':>11}{'p50':>10}"
          f"{'p99':>10}{'route p50':>11}  decisions")
    for row in rows:
        if row.get("reference"):
            print(f"{row['policy']:<24}{row['hit_rate'] * 100:>8.2f}%  (reference: one cache "
                  "of all the engines' capacity, no queue)")
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["reasons"].items()))
        print(f"{row['policy']:<24}{row['hit_rate'] * 100:>8.2f}%"
              f"{row['imbalance_max_over_mean']:>10.2f}{row['ttft_mean_s']:>10.2f}s"
              f"{row['ttft_p50_s']:>9.2f}s{row['ttft_p99_s']:>9.2f}s"
              f"{row['route_p50_ms']:>9.2f}ms  {reasons}")
    return {"header": header, "args": {k: str(v) for k, v in vars(args).items()},
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cpus", "rows": rows}


async def run(args: argparse.Namespace) -> int:
    if not args.trace.is_file():
        raise SystemExit(f"router_replay: no trace at {args.trace} (--trace)")
    trace = read_trace(args.trace, args.limit)
    if not trace:
        raise SystemExit(f"router_replay: no requests in {args.trace}")
    span = trace[-1].t_s - trace[0].t_s
    report_from_s = trace[0].t_s + args.report_from * span
    manager = None
    address = args.manager
    if not address and any(n.startswith("kv-aware") for n in args.policies):
        manager = ManagerProcess(find_manager_binary(args.manager_bin))
        await manager.wait()
        address = manager.address
    closers: List[Any] = []
    try:
        arms, closers = await build_arms(args, address, report_from_s)
        everything: List[Any] = list(arms)
        if args.reference:
            everything.append(PooledReference(args, report_from_s))
        start = time.perf_counter()
        for i, r in enumerate(trace):
            tokens = tokens_of(r)
            for arm in everything:
                await arm.serve(r, tokens)
            if args.progress and (i + 1) % args.progress == 0:
                print(f"  {i + 1} / {len(trace)} requests, {time.perf_counter() - start:.0f} s",
                      file=sys.stderr)
        out = report(args, everything, trace, report_from_s, time.perf_counter() - start)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
    finally:
        for close in closers:
            await close()
        if manager is not None:
            manager.stop()
    return 0


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--smoke", action="store_true", help="first 300 requests")
    p.add_argument("--policies", default="kv-aware,round-robin,consistent-hash,least-loaded,"
                   "kv-aware:guard=2/4,kv-aware:noguard,consistent-hash:noguard",
                   help="comma-separated arms: POLICY, POLICY:noguard (no imbalance guard) or "
                        "POLICY:guard=FACTOR/MARGIN")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--capacity_blocks", type=int, default=1000,
                   help="engine KV cache, blocks (1000 x 512 tokens: ~64 GB of Llama-3-8B KV)")
    p.add_argument("--block_size", type=int, default=TRACE_BLOCK_TOKENS,
                   help="engine block size, tokens")
    p.add_argument("--page_size", type=int, default=TRACE_BLOCK_TOKENS,
                   help="kvcm page size, tokens (a multiple of the block size)")
    p.add_argument("--prefill_tokens_per_s", type=float, default=16_000.0)
    p.add_argument("--decode_ms_per_token", type=float, default=20.0)
    # Chosen on the first half of the Mooncake conversation trace, by mean TTFT over 1,000-
    # and 10,000-block engines, among none, 1.5/2, 2/4, 2/8, 2/16 and 4/16 (docs/PERFORMANCE.md).
    p.add_argument("--imbalance_factor", type=float, default=2.0)
    p.add_argument("--imbalance_margin", type=int, default=16)
    p.add_argument("--report_from", type=float, default=0.5,
                   help="report requests after this fraction of the replayed span")
    p.add_argument("--no_reference", dest="reference", action="store_false",
                   help="skip the one-big-cache reference row")
    p.add_argument("--manager", default="", help="a running manager (else one is started)")
    p.add_argument("--manager_bin", default="")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--progress", type=int, default=0, help="log every N requests")
    args = p.parse_args(argv)
    if args.smoke:
        args.limit = args.limit or 300
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for name in args.policies:
        try:
            arm_guard(name, args)
        except ValueError as e:
            p.error(f"--policies: {name}: {e}")
    if args.page_size % args.block_size:
        p.error("--page_size: must be a multiple of --block_size")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
