#!/usr/bin/env python3
"""kvcm's vLLM connector end to end with real vLLM engines (CPU build), MLA beside GQA:

1. time to first token (TTFT) of a prompt engine B loads from kvcm after engine A stored it
   (B's agent fetches the pages from A's, then B loads them; "hit, fetched"), of the same
   prompt sent to B again (its own agent holds it: "hit, local"), and of a fresh prompt of
   the same length on B ("miss"), per prompt length;
2. the agents' bytes per cached token (BlockAgent Stats used_bytes over the tokens the
   manager indexes in their pools, and the connector's own byte counts) for the MLA model
   and for GQA/MHA Llamas of the same width, beside kvcm's formula (ModelSpec);
3. the miss TTFT of an engine without a connector ("plain") beside B's, and the bench's own
   timing of the connector's scheduler-side round (hash + Route with pin + Release);
4. the same-engine hit and miss TTFT of vLLM's ExampleConnector (and SimpleCPUOffload /
   Offloading connectors, whose outcome on the CPU build is reported) beside kvcm's.

    build/test/pyenv/bin/python bench/vllm_connector_e2e_bench.py \\
        --manager_bin build/test/server/kvcm-manager --agent_bin build/test/gpu/agent/kvcm-agent \\
        --vllm_python build/test/vllm-venv/bin/python [--smoke] [--reps N] [--lengths 250,1000]

TTFT: a streamed /v1/completions (greedy, max_tokens 2), from sending the request to its
first chunk. Every kvcm hit must load every whole page but the last token's (usage's
cached_tokens); the texts of hits are compared (checks at the end). After a warm-up round,
each repetition rotates the order of the configurations and of the lengths; every sample
counts the other vLLM servers running on the machine. At most 3 engines run at once. The
default lengths end off a page boundary except 2048 (a hit on a prompt ending on a page
boundary computes that last page and stores it again).

Models (bench/vllm_e2e_rig.py, random real weights; the tests' rigs.tiny_deepseek and
rigs.tiny_llama): the tiny DeepSeek (MLA, kv_lora_rank 512 + rope 64, 2 layers, hidden 256, 4
heads; vLLM's CPU_MLA, block 16, which turns vLLM's prefix cache off) and the tiny Llama with
the same layers, hidden, MLP and query heads (head_dim 64 = hidden / heads) and 2 KV heads
(GQA) or 4 (MHA, as the tiny DeepSeek's num_key_value_heads); block 32 (vLLM's CPU attention
refuses 16). Exits 77 when the vLLM python is missing, unless KVCM_REQUIRE_VLLM=1 or
KVCM_REQUIRE_PYTHON=1 (as the tests' conftest decides).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvcm
from vllm_e2e_rig import GQA, MHA, MLA, Bench, EngineSpec


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manager_bin", required=True)
    p.add_argument("--agent_bin", required=True)
    p.add_argument("--vllm_python", default=os.environ.get("KVCM_VLLM_PYTHON", ""))
    p.add_argument("--smoke", action="store_true",
                   help="one 100-token prompt, one repetition, both models (CI)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--lengths", default="250,1000,2000,2048,4000",
                   help="prompt tokens, comma-separated (at most 4000)")
    p.add_argument("--quiet_wait_s", type=float, default=0,
                   help="before each repetition, wait at most this long for other vLLM "
                        "servers on the machine to be gone 10 s")
    p.add_argument("--workdir", default="")
    p.add_argument("--phases", default="mla,peers,gqa,stores",
                   help="comma-separated: mla (hit/miss/plain), peers (vLLM's connectors), "
                        "gqa (GQA/MHA bytes and TTFT), stores (kv_both stores in the step "
                        "vs in the background)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.phases = set(args.phases.split(","))
    if args.smoke:
        args.reps, args.lengths = 1, [100]
    return args


# ---- phases and report --------------------------------------------------------------------

A, B = EngineSpec("mla-A", MLA, "kvcm", "mla0"), EngineSpec("mla-B", MLA, "kvcm", "mla1")
P, X = EngineSpec("mla-P", MLA, None), EngineSpec("mla-X", MLA, "example")
GA, GB = EngineSpec("gqa-A", GQA, "kvcm", "gqa0"), EngineSpec("gqa-B", GQA, "kvcm", "gqa1")
GP, M = EngineSpec("gqa-P", GQA, None), EngineSpec("mha-A", MHA, "kvcm", "mha0")
PAIRED_LENGTHS, PAIRS = (250, 1000), 40
AGENTS = (("mla0", MLA), ("mla1", MLA), ("gqa0", GQA), ("gqa1", GQA), ("mha0", MHA))


def mla_phase(bench: Bench, extra: dict) -> None:
    """MLA: hit (fetched, local) and miss through kvcm, beside an engine without it (smoke:
    beside ExampleConnector instead, to keep one engine start)."""
    smoke = bench.args.smoke
    bench.run_engines([A, B, X] if smoke else [A, B, P])
    jobs = [lambda n: bench.cross_hit("mla-A", "mla-B", n),
            lambda n: bench.miss("mla-B", n, "kvcm miss")]
    jobs.append(lambda n: bench.same_engine(["mla-B", "mla-X"], n) if smoke
                else bench.miss("mla-P", n, "plain miss"))
    bench.rounds(jobs)
    extra["agents' measured pull_gbps (manager stats)"] = {
        a.agent_id: round(a.pull_gbps, 3) for a in bench.client.stats().agents}
    extra["mla1 Fetch RPCs and their pulls (count, mean ms; warm-up included)"] = \
        bench.agent_timings("mla1")
    if not smoke:  # what the connector adds to a miss, in pairs (finer than the rounds)
        for n in [n for n in PAIRED_LENGTHS if n <= max(bench.args.lengths)]:
            diffs = bench.paired_misses(["mla-P", "mla-B"], n, PAIRS)
            extra[f"MLA {n}: kvcm miss - plain miss, per pair ({PAIRS} pairs), ms"] = (
                f"median {1e3 * statistics.median(diffs):+.2f}, quartiles "
                + ", ".join(f"{1e3 * q:+.2f}" for q in statistics.quantiles(diffs, n=4)))
    sched = bench.scheduler_round("mla1", MLA)
    extra["MLA scheduler round ms (hash + Route with pin + Release, median of 30)"] = {
        f"{k} {n}": round(v, 3) for (k, n), v in sched.items()}
    for what, label in (("loaded", "kvcm hit, fetched"), ("loaded", "kvcm hit, local"),
                        ("copied", "kvcm miss")):
        ms = bench.log_ms("mla-B", what)
        for n in bench.args.lengths:
            got = [v for s in bench.results.samples.get((f"{MLA.name} {label}", n), [])
                   for rid, v in ms.items() if rid.startswith(s.rid + "-")]
            if got:
                extra[f"mla-B {label} {n}: connector's {what} ms, median"] = round(
                    statistics.median(got), 3)


def peer_phase(bench: Bench, extra: dict) -> None:
    """vLLM's own connectors on the same engine kind, model and prompts as kvcm's B."""
    for kind in ("offloading", "simple"):
        error = bench.try_engine([B], EngineSpec(f"mla-{kind}", MLA, kind))
        extra[f"{kind} connector on the CPU build (MLA)"] = error or "serves"
    peers = [B, X] + ([bench.specs["mla-simple"]] if "mla-simple" in bench.engines else [])
    bench.run_engines(peers)
    bench.rounds([lambda n: bench.same_engine([s.name for s in peers], n)])
    if "mla-simple" in bench.logs and "disabling CPU offload" in bench.logs[
            "mla-simple"].read_text(errors="replace"):
        extra["simple connector on MLA"] = ("serves, but logs 'Detected prefix caching "
                                            "disabled, disabling CPU offload'")


def stores_phase(bench: Bench, extra: dict) -> None:
    """A miss's TTFT with the step's stores copied in the step (background_stores false)
    and on the connector's background thread (the default), in pairs on two engines of the
    same model sharing one agent."""
    inline = EngineSpec("mla-S", MLA, "kvcm", "mla1", {"background_stores": False})
    bench.run_engines([B, inline])
    for n in [n for n in PAIRED_LENGTHS + (2000,) if n <= max(bench.args.lengths)]:
        diffs = bench.paired_misses(["mla-S", "mla-B"], n, PAIRS)
        extra[f"MLA {n}: background stores - stores in the step, miss TTFT per pair "
              f"({PAIRS} pairs), ms"] = (
            f"median {1e3 * statistics.median(diffs):+.2f}, quartiles "
            + ", ".join(f"{1e3 * q:+.2f}" for q in statistics.quantiles(diffs, n=4)))


def gqa_phase(bench: Bench) -> None:
    """GQA and MHA at the MLA model's width: their bytes per token, GQA's hit and miss."""
    if bench.args.smoke:
        bench.run_engines([GA, GP])
        bench.rounds([lambda n: bench.same_engine(["gqa-A"], n),
                      lambda n: bench.miss("gqa-P", n, "plain miss")])
        return
    bench.run_engines([GA, GB, M])
    bench.rounds([lambda n: bench.cross_hit("gqa-A", "gqa-B", n),
                  lambda n: bench.miss("gqa-B", n, "kvcm miss"),
                  lambda n: bench.miss("mha-A", n, "kvcm miss")])


def bytes_table(bench: Bench) -> None:
    print("\n## Agent bytes per cached token: measured vs kvcm's formula\n")
    print("| model | agent | used_bytes | tokens indexed | measured B/token | formula B/token |")
    print("|---|---|---|---|---|---|")
    measured = {}
    for agent, model in AGENTS:
        used, tokens = bench.agent_bytes(agent)
        if tokens:
            measured[model.name] = used / tokens
            print(f"| {model.name} | {agent} | {used:,} | {tokens:,} | {used / tokens:,.1f} | "
                  f"{model.bytes_per_token:,} |")
    print("\n| engine | bytes its connector moved (stores + loads) | tokens | B/token |")
    print("|---|---|---|---|")
    for name, spec in bench.specs.items():
        moved, tokens = bench.connector_bytes(name) if spec.connector == "kvcm" else (0, 0)
        if tokens:
            print(f"| {name} | {moved:,} | {tokens:,} | {moved / tokens:,.1f} |")
    print()
    for other in (GQA, MHA):
        if MLA.name in measured and other.name in measured:
            print(f"MLA / {other.name} bytes per token: measured "
                  f"{measured[MLA.name] / measured[other.name]:.4f}, formula "
                  f"{MLA.bytes_per_token / other.bytes_per_token:.4f}")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted(values)[max(1, math.ceil(q * len(values))) - 1]


def report(bench: Bench, extra: dict) -> None:
    res, lengths = bench.results, bench.args.lengths
    print("\n## TTFT, ms\n")
    print("| configuration | tokens | n | median | p90 | min–max | cached tokens (median) | "
          "samples with another vLLM running |")
    print("|---|---|---|---|---|---|---|---|")
    for label in sorted({label for label, _ in res.samples}):
        for length in lengths:
            s = res.samples.get((label, length))
            if s:
                ms = [1e3 * x.ttft_s for x in s]
                print(f"| {label} | {length} | {len(s)} | {statistics.median(ms):,.1f} | "
                      f"{pct(ms, 0.9):,.1f} | {min(ms):,.1f}–{max(ms):,.1f} | "
                      f"{statistics.median(x.cached for x in s):.0f} | "
                      f"{sum(1 for x in s if x.foreign)} |")
    med = {k: statistics.median(x.ttft_s for x in v) for k, v in res.samples.items()}
    print("\n## Ratios of medians\n")
    for model in (MLA, GQA):
        for n in lengths:
            miss = med.get((f"{model.name} kvcm miss", n))
            for hit in ("hit, fetched", "hit, local"):
                h = med.get((f"{model.name} kvcm {hit}", n))
                if miss and h:
                    print(f"{model.name} {n}: miss / {hit} = {miss / h:.2f}x")
            plain = med.get((f"{model.name} plain miss", n))
            if miss and plain:
                print(f"{model.name} {n}: kvcm miss - plain miss = {1e3 * (miss - plain):+.1f} "
                      f"ms ({miss / plain:.3f}x)")
        for n in lengths:
            for c in ("kvcm", "example", "simple"):
                m = med.get((f"{model.name} {c} miss (same-engine pair)", n))
                h = med.get((f"{model.name} {c} hit (same-engine pair)", n))
                if m and h:
                    print(f"{model.name} {n} same engine, {c}: miss {1e3 * m:.1f} ms, hit "
                          f"{1e3 * h:.1f} ms, miss / hit {m / h:.2f}x")
    for key, value in extra.items():
        print(f"{key}: {value}")
    for what, (true, total) in res.checks.items():
        print(f"check: {what}: {true} of {total}")
    raw = {f"{label} @{n}": [vars(s) for s in v] for (label, n), v in res.samples.items()}
    (bench.dir / "results.json").write_text(json.dumps(
        {"samples": raw, "extra": {k: str(v) for k, v in extra.items()}}, indent=1))
    print(f"# raw samples: {bench.dir / 'results.json'}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not args.vllm_python or not os.access(args.vllm_python, os.X_OK):
        required = "1" in (os.environ.get("KVCM_REQUIRE_VLLM"),
                           os.environ.get("KVCM_REQUIRE_PYTHON"))
        print(f"no vLLM python ({args.vllm_python!r}): --vllm_python or $KVCM_VLLM_PYTHON "
              f"(scripts/vllm_env.sh); {'failing' if required else 'skipping'}")
        return 1 if required else 77
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvcm-vllm-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"# workdir {workdir}; load {os.getloadavg()}", flush=True)
    bench, extra = Bench(args, workdir), {}
    try:
        bench.manager.start()
        bench.client = kvcm.Client(bench.manager.address, insecure=True)
        tokens = sum(args.lengths) * (args.reps + 2) * 4  # room for every page: no eviction
        for agent, model in AGENTS:
            bench.start_agent(agent, model, tokens * model.bytes_per_token + (64 << 20))
        bench.wait_agents()
        try:
            if "mla" in args.phases:
                mla_phase(bench, extra)
            if not args.smoke and "peers" in args.phases:
                peer_phase(bench, extra)
            if not args.smoke and "stores" in args.phases:
                stores_phase(bench, extra)
            if "gqa" in args.phases:
                gqa_phase(bench)
        finally:  # what was measured, also when a phase failed
            bytes_table(bench)
            report(bench, extra)
    finally:
        bench.stop()
    print(f"# done in {time.monotonic() - started:.0f} s; load {os.getloadavg()}")
    if args.smoke and not args.workdir:  # ctest's: leave nothing behind
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
