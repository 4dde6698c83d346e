"""The processes and measurements of bench/vllm_connector_e2e_bench.py: a kvcm-manager,
kvcm-agents sized for each model, real vLLM servers (the tests' rigs.vllm_engine) with kvcm's
or vLLM's own KV connectors, and timed requests (time to first streamed token) with the checks
that make a hit a hit. Run with the Python client's environment (kvcm installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

import kvcm
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc

# The rigs are the repository's test helpers, not part of the installed kvcm package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client" / "python" / "tests"))
from rigs import tiny_deepseek, tiny_llama  # noqa: E402
from rigs.manager import ManagerProcess, free_port  # noqa: E402
from rigs.vllm_engine import MODEL_NAME, VllmEngine  # noqa: E402

TENANT = "bench"
MAX_TOKENS = 2
MAX_ENGINES = 3
PREFILL_TOKENS_PER_S = 1000  # for Route's cost model only (see connector_config)
# After a step, a vLLM worker spins on its shared-memory queue for 1 s (shm_broadcast's
# busy_loop_s) before it sleeps: on 2 cores, an engine that just answered slows the next
# request to another engine. A request waits until every other engine is this long idle.
QUIET_S = 1.5


@dataclass(frozen=True)
class Model:
    """A model under test: its directory's config, the kvcm spec the connector registers
    for it, and the agent flags that size an agent for it."""

    name: str  # also its kvcm namespace's model
    spec: kvcm.ModelSpec
    llama_overrides: dict | None = None  # None: tiny_deepseek

    @property
    def block(self) -> int:
        return self.spec.page_size_tokens

    @property
    def bytes_per_token(self) -> int:  # kvcm's formula
        return self.spec.bytes_per_token_per_layer() * self.spec.num_layers

    def agent_flags(self) -> list[str]:
        s = self.spec
        flags = [f"--num_layers={s.num_layers}", f"--num_heads={s.num_heads}",
                 "--kv_dtype=bf16", f"--page_size_tokens={s.page_size_tokens}"]
        if s.attention == kvcm.AttentionKind.MLA:
            return flags + ["--attention=mla", f"--kv_lora_rank={s.kv_lora_rank}",
                            f"--rope_dim={s.rope_dim}"]
        return flags + ["--attention=gqa", f"--num_kv_heads={s.num_kv_heads}",
                        f"--head_dim={s.head_dim}"]

    def write(self, directory: Path, vllm_python: str) -> Path:
        if self.llama_overrides is None:
            return tiny_deepseek.write_with_weights(directory, vllm_python)
        return tiny_llama.add_weights(tiny_llama.write(directory, **self.llama_overrides),
                                      vllm_python)


MLA = Model("tiny-deepseek", kvcm.ModelSpec(
    kvcm.AttentionKind.MLA, num_layers=tiny_deepseek.NUM_LAYERS, num_heads=4,
    kv_lora_rank=tiny_deepseek.KV_LORA_RANK, rope_dim=tiny_deepseek.ROPE_DIM,
    qk_nope_head_dim=32, v_head_dim=32, page_size_tokens=tiny_deepseek.BLOCK_SIZE))


def llama(kv_heads: int) -> Model:
    """The tiny Llama at the tiny DeepSeek's width: 2 layers, hidden 256, MLP 512, 4 query
    heads of 64; `kv_heads` KV heads."""
    spec = kvcm.ModelSpec(kvcm.AttentionKind.GQA, num_layers=2, num_heads=4,
                          num_kv_heads=kv_heads, head_dim=64, page_size_tokens=32)
    return Model(f"tiny-llama-kv{kv_heads}", spec, dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=64))


GQA, MHA = llama(2), llama(4)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its model and connector ("kvcm", "example", "simple", "offloading" or
    None), and for kvcm its agent."""

    name: str
    model: Model
    connector: str | None
    agent: str = ""
    options: dict = field(default_factory=dict)  # kvcm: more kv_connector_extra_config


@dataclass
class Sample:
    ttft_s: float
    cached: int
    text: str
    rid: str
    foreign: int  # other vLLM servers running when it was taken


@dataclass
class Results:
    samples: dict = field(default_factory=dict)  # (label, length) -> [Sample]
    checks: dict = field(default_factory=dict)  # what -> [times true, times checked]

    def add(self, label: str, length: int, s: Sample) -> None:
        self.samples.setdefault((label, length), []).append(s)

    def check(self, what: str, ok: bool) -> None:
        counts = self.checks.setdefault(what, [0, 0])
        counts[0] += ok
        counts[1] += 1


def foreign_engines(mine: set[int]) -> int:
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True)
    return len({int(p) for p in out.stdout.split()} - mine)


class Bench:
    """The manager, the agents, the engines and the measurements of one run. Not
    thread-safe."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args, self.dir = args, workdir
        self.manager = ManagerProcess(args.manager_bin, workdir / "manager")
        self.client: kvcm.Client | None = None
        self.agents: dict[str, tuple[subprocess.Popen, str, Model]] = {}
        self.metrics: dict[str, str] = {}  # agent -> its Prometheus /metrics URL
        self.engines: dict[str, VllmEngine] = {}
        self.specs: dict[str, EngineSpec] = {}
        self.logs: dict[str, Path] = {}  # every engine's log, also once stopped
        self.model_dirs: dict[str, Path] = {}
        self.results = Results()
        self.seed = 0
        self.last_answer: dict[str, float] = {}  # engine -> when its last answer ended

    # ---- processes -----------------------------------------------------------------------

    def start_agent(self, agent_id: str, model: Model, capacity_bytes: int) -> None:
        port, metrics = free_port(), free_port()
        args = [self.args.agent_bin, "--insecure", f"--agent_id={agent_id}",
                f"--manager_address={self.manager.address}",
                f"--listen_address=127.0.0.1:{port}", "--use_device=false", "--model=",
                *model.agent_flags(), f"--capacity_bytes={capacity_bytes}",
                "--heartbeat_interval_ms=200", f"--local_socket={self.dir / agent_id}.sock",
                f"--metrics_address=127.0.0.1:{metrics}"]
        log = open(self.dir / f"{agent_id}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.agents[agent_id] = (proc, f"127.0.0.1:{port}", model)
        self.metrics[agent_id] = f"http://127.0.0.1:{metrics}/metrics"

    def wait_agents(self) -> None:
        deadline = time.monotonic() + 30
        while not set(self.agents) <= {a.agent_id for a in self.client.stats().agents
                                       if a.alive}:
            for agent_id, (proc, _, _) in self.agents.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"agent {agent_id} exited: "
                                       + (self.dir / f"{agent_id}.log").read_text())
            if time.monotonic() > deadline:
                raise RuntimeError("the agents did not register")
            time.sleep(0.1)

    def connector_config(self, spec: EngineSpec) -> dict | None:
        if spec.connector is None:
            return None
        if spec.connector == "kvcm":
            _, address, _ = self.agents[spec.agent]
            return {"kv_connector": "KvcmConnector",
                    "kv_connector_module_path": "kvcm.vllm.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "manager_address": self.manager.address, "agent_id": spec.agent,
                        "agent_address": address, "tenant": TENANT, "model": spec.model.name,
                        "local_socket": f"{self.dir / spec.agent}.sock",
                        # Route's cost model fetches when a page's transfer at the link rate
                        # the agent measured beats its prefill at this rate. The rate
                        # measured on small loopback pulls can be low enough that Route
                        # recomputes instead; a low prefill rate keeps every hit a fetch.
                        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S, **spec.options}}
        if spec.connector == "example":
            path = self.dir / f"{spec.name}-store"
            path.mkdir(exist_ok=True)
            return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(path)}}
        name = {"simple": "SimpleCPUOffloadConnector", "offloading": "OffloadingConnector"}
        return {"kv_connector": name[spec.connector], "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28}}

    def engine(self, spec: EngineSpec) -> VllmEngine:
        model = spec.model
        if model.name not in self.model_dirs:
            self.model_dirs[model.name] = model.write(self.dir / model.name,
                                                      self.args.vllm_python)
        args: tuple[str, ...] = ("--seed", "0", "--load-format", "safetensors")
        config = self.connector_config(spec)
        if config is not None:
            args += ("--kv-transfer-config", json.dumps(config))
        pythonpath = self.dir / "pythonpath"  # kvcm alone: conftest.kvcm_pythonpath
        pythonpath.mkdir(exist_ok=True)
        if not (pythonpath / "kvcm").exists():
            (pythonpath / "kvcm").symlink_to(Path(kvcm.__file__).parent)
        # A KV cache of two longest requests (not vLLM's 1 GiB): 3 engines on a shared VM.
        max_len = max(self.args.lengths) + 64
        e = VllmEngine(self.dir / spec.name, python=self.args.vllm_python,
                       model_dir=self.model_dirs[model.name], block_size=model.block,
                       block_bytes=model.bytes_per_token * model.block,
                       num_blocks=2 * (max_len // model.block) + 8, max_model_len=max_len,
                       extra_args=args, extra_env={"PYTHONPATH": str(pythonpath)},
                       start_timeout_s=900)
        self.specs[spec.name], self.logs[spec.name] = spec, e.log_path
        return e

    def run_engines(self, specs: list[EngineSpec]) -> None:
        """Stops the running engines not in `specs`, then starts the others together."""
        assert len(specs) <= MAX_ENGINES
        wanted = {s.name for s in specs}
        for name in [n for n in self.engines if n not in wanted]:
            self.engines.pop(name).stop()
        new = [self.engine(s) for s in specs if s.name not in self.engines]
        for s, e in zip([s for s in specs if s.name not in self.engines], new):
            self.engines[s.name] = e.launch()
        started = time.monotonic()
        for e in new:
            e.wait_healthy()
        if new:
            print(f"# started {[s.name for s in specs]} in {time.monotonic() - started:.0f} s",
                  flush=True)

    def try_engine(self, keep: list[EngineSpec], spec: EngineSpec) -> str:
        """Starts an engine that may not run on the CPU build beside `keep`: '' if it
        serves, else the last error it logged."""
        try:
            self.run_engines(keep + [spec])
        except RuntimeError as e:
            self.engines.pop(spec.name, None)  # wait_healthy stopped it
            log = self.logs[spec.name].read_text(errors="replace")
            cause = re.search(r"ERROR .*?\] (\w*(?:Error|Exception): .*)", log)
            return cause.group(1).strip() if cause else str(e)[-300:]
        return ""

    def stop(self) -> None:
        for e in self.engines.values():
            e.stop()
        if self.client is not None:
            self.client.close()
        for proc, _, _ in self.agents.values():
            proc.terminate()
            proc.wait(10)
        self.manager.stop()

    # ---- requests ------------------------------------------------------------------------

    def prompt(self, length: int) -> list[int]:
        """A fresh prompt: random token ids, a new seed each time."""
        self.seed += 1
        rng = random.Random(self.seed)
        return [rng.randrange(1000) for _ in range(length)]

    def ttft(self, name: str, tokens: list[int]) -> Sample:
        """A streamed completion: seconds from sending it to its first chunk, and its
        usage's cached_tokens."""
        e = self.engines[name]
        mine = {x.proc.pid for x in self.engines.values() if x.proc is not None}
        foreign = foreign_engines(mine)
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        req = urllib.request.Request(e.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        first, text, cached, rid = 0.0, "", 0, ""
        others = [t for n, t in self.last_answer.items() if n != name]
        time.sleep(max(0.0, max(others, default=0.0) + QUIET_S - time.monotonic()))
        sent = time.monotonic()
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if not first and chunk.get("choices"):
                    first = time.monotonic()
                rid = rid or chunk.get("id", "")
                text += "".join(c.get("text", "") for c in chunk.get("choices") or [])
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or cached)
        self.last_answer[name] = time.monotonic()
        if not first:
            raise RuntimeError(f"{name}: no streamed token:\n" + e.log_tail())
        return Sample(first - sent, cached, text, rid, foreign)

    def local_pages(self, agent: str, model: Model, tokens: list[int]) -> int:
        return self.client.match((TENANT, model.name), tokens, requester_agent_id=agent,
                                 probe=True).local_pages

    def wait_stored(self, agent: str, model: Model, tokens: list[int]) -> None:
        """Until the manager indexes the prompt's whole pages in `agent` (background inserts
        done, so that they do not overlap the next sample)."""
        want, deadline = len(tokens) // model.block, time.monotonic() + 60
        while self.local_pages(agent, model, tokens) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{agent} did not store the prompt")
            time.sleep(0.01)

    def reset(self, name: str) -> None:
        """Empties vLLM's own prefix cache (GQA: the second send would hit it)."""
        if self.specs[name].model.spec.attention != kvcm.AttentionKind.MLA:
            self.engines[name].reset_prefix_cache()

    # ---- measurements --------------------------------------------------------------------

    def hit(self, name: str, tokens: list[int], label: str) -> Sample:
        """A request that should load every whole page but the last token's from the
        engine's connector (kvcm: an error if it does not)."""
        spec, s = self.specs[name], self.ttft(name, tokens)
        loadable = (len(tokens) - 1) // spec.model.block * spec.model.block
        if spec.connector == "kvcm" and s.cached != loadable:
            raise RuntimeError(f"{name} {label}: cached {s.cached} of {loadable}:\n"
                               + self.engines[name].log_tail())
        self.results.check(f"{spec.model.name} {spec.connector}: a hit loads every whole "
                           "page", s.cached == loadable)
        self.results.add(f"{spec.model.name} {label}", len(tokens), s)
        return s

    def cross_hit(self, writer: str, reader: str, length: int) -> None:
        """The writer computes and stores a prompt; the reader loads it (its agent fetches
        it from the writer's), then loads it again from its own agent."""
        w, r = self.specs[writer], self.specs[reader]
        model, p = w.model, self.prompt(length)
        first = self.ttft(writer, p)
        self.results.add(f"{model.name} kvcm writer miss", length, first)
        self.wait_stored(w.agent, model, p)
        fetched = self.hit(reader, p, "kvcm hit, fetched")
        self.wait_stored(r.agent, model, p)
        self.reset(reader)
        local = self.hit(reader, p, "kvcm hit, local")
        self.reset(reader)
        self.results.check(f"{model.name}: text of a hit = text of the writer's prefill",
                           fetched.text == first.text)
        self.results.check(f"{model.name}: text of the local hit = text of the fetched hit",
                           local.text == fetched.text)

    def miss(self, name: str, length: int, label: str) -> None:
        spec = self.specs[name]
        p = self.prompt(length)
        s = self.ttft(name, p)
        assert s.cached == 0, s
        self.results.add(f"{spec.model.name} {label}", length, s)
        if spec.connector == "kvcm":
            self.wait_stored(spec.agent, spec.model, p)

    def same_engine(self, names: list[str], length: int) -> None:
        """One prompt sent twice to each engine (a miss that stores, then a hit that loads
        from the engine's own connector), for each connector in turn."""
        p, texts = self.prompt(length), {}
        for name in names:
            spec = self.specs[name]
            first = self.ttft(name, p)
            assert first.cached == 0, first
            self.results.add(f"{spec.model.name} {spec.connector} miss (same-engine pair)",
                             length, first)
            if spec.connector == "kvcm":
                self.wait_stored(spec.agent, spec.model, p)
            self.reset(name)
            texts[spec.connector] = self.hit(name, p, f"{spec.connector} hit (same-engine "
                                             "pair)").text
        for connector, text in texts.items():
            if connector != "kvcm" and "kvcm" in texts:
                self.results.check(f"text of the {connector} connector's hit = kvcm's",
                                   text == texts["kvcm"])

    def paired_misses(self, names: list[str], length: int, pairs: int) -> list[float]:
        """Fresh prompts to each engine in turn, the order swapped every pair: seconds of
        TTFT of names[1] minus names[0], per pair (both recorded as "... miss, paired")."""
        diffs = []
        for i in range(pairs):
            ttft = {}
            for name in names if i % 2 == 0 else names[::-1]:
                spec, p = self.specs[name], self.prompt(length)
                s = self.ttft(name, p)
                label = spec.connector or "plain"
                if spec.options:
                    label += " " + ",".join(f"{k}={v}" for k, v in spec.options.items())
                self.results.add(f"{spec.model.name} {label} miss, paired", length, s)
                ttft[name] = s.ttft_s
                if spec.connector == "kvcm":
                    self.wait_stored(spec.agent, spec.model, p)
            diffs.append(ttft[names[1]] - ttft[names[0]])
        return diffs

    def wait_quiet(self) -> None:
        """Until no other vLLM server has run for 10 s, at most --quiet_wait_s."""
        mine = {e.proc.pid for e in self.engines.values() if e.proc is not None}
        deadline, quiet_since = time.monotonic() + self.args.quiet_wait_s, time.monotonic()
        while time.monotonic() < deadline:
            if foreign_engines(mine):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= 10:
                return
            time.sleep(1)

    def warm_up(self, jobs: list) -> None:
        """Every job once at every length, not recorded: one-off costs (allocations, first
        kernels, the first load and fetch)."""
        kept = self.results.samples, self.results.checks
        self.results.samples, self.results.checks = {}, {}
        for length in self.args.lengths:
            for job in jobs:
                job(length)
        self.results.samples, self.results.checks = kept
        time.sleep(1)

    def rounds(self, jobs: list) -> None:
        """Each repetition runs every job at every length, rotating the order of both (after
        a warm-up round)."""
        self.warm_up(jobs)
        lengths = self.args.lengths
        for rep in range(self.args.reps):
            self.wait_quiet()
            order = lengths[rep % len(lengths):] + lengths[:rep % len(lengths)]
            for length in order:
                k = (rep + length) % len(jobs)
                for job in jobs[k:] + jobs[:k]:
                    job(length)
            print(f"# rep {rep + 1}/{self.args.reps} load {os.getloadavg()[0]:.1f}", flush=True)

    def scheduler_round(self, agent: str, model: Model, n: int = 30) -> dict:
        """What the connector's scheduler side sends per request, timed from this process
        (hash + Route with pin for one agent + Release), on a prompt the agent lacks and
        on one it holds, per length; ms, median."""
        self.client.register_model((TENANT, model.name), model.spec)  # its hash key
        out = {}
        for length in self.args.lengths:
            cached = self.prompt(length)
            self.ttft(next(n for n, s in self.specs.items() if s.agent == agent
                           and n in self.engines), cached)
            self.wait_stored(agent, model, cached)
            for kind, p in (("miss", self.prompt(length)), ("hit", cached)):
                tokens = p[: (length - 1) // model.block * model.block]
                times = []
                for _ in range(n):
                    start = time.perf_counter()
                    hashes = self.client.hash_prompt((TENANT, model.name), tokens)
                    route = self.client.route((TENANT, model.name), page_hashes=hashes,
                                              candidates=[agent], pin=True,
                                              lease_ttl_ms=60_000, deadline_ms=500)
                    if route.match.pin_id:
                        self.client.release((TENANT, model.name), route.match.pin_id)
                    times.append(time.perf_counter() - start)
                out[(kind, length)] = 1e3 * statistics.median(times)
        return out

    def agent_bytes(self, agent: str) -> tuple[int, int]:
        """(BlockAgent Stats used_bytes, tokens the manager indexes in the agent's pool)."""
        _, address, model = self.agents[agent]
        with grpc.insecure_channel(address) as ch:
            stats = agent_pb2_grpc.BlockAgentStub(ch).Stats(
                agent_pb2.BlockAgentStatsRequest(), timeout=10)
        pages = sum(p.pages for p in self.client.stats().pools if p.pool.agent_id == agent)
        return stats.used_bytes, pages * model.block

    def agent_timings(self, agent: str) -> dict[str, tuple[int, float]]:
        """From the agent's /metrics: (count, mean ms) of its Fetch RPCs and of the pulls
        inside them (connect to last byte)."""
        with urllib.request.urlopen(self.metrics[agent], timeout=10) as r:
            text = r.read().decode()

        def value(name: str, labels: str) -> float:
            m = re.search(rf"^{name}(?:{{{labels}}})? ([\d.e+-]+)$", text, re.M)
            return float(m.group(1)) if m else 0.0

        out = {}
        for what, name, labels in (("Fetch RPC", "kvcm_agent_rpc_duration_seconds",
                                    '.*rpc="Fetch".*'),
                                   ("pull", "kvcm_transfer_seconds", "")):
            count = int(value(name + "_count", labels))
            out[what] = (count, 1e3 * value(name + "_sum", labels) / count if count else 0.0)
        return out

    def connector_bytes(self, name: str) -> tuple[int, int]:
        """(bytes, tokens) of every store and load the engine's connector logged."""
        log = self.logs[name].read_text(errors="replace")
        block = self.specs[name].model.block
        moved = re.findall(r"(?:copied (\d+) pages|loaded (\d+) blocks) of \S+.*?: (\d+) bytes",
                           log)
        return (sum(int(b) for _, _, b in moved),
                sum(int(a or c) * block for a, c, _ in moved))

    def log_ms(self, name: str, what: str) -> dict[str, float]:
        """Request id -> ms of the connector's load ("loaded") or store ("copied")."""
        log = self.logs[name].read_text(errors="replace")
        pattern = rf"KvcmConnector: {what} \d+ \w+ of (\S+).*? in ([\d.]+) ms"
        return {rid: float(ms) for rid, ms in re.findall(pattern, log)}
