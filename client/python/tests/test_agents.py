"""Route and agent-committed inserts: a manager and two kvcm-agent processes (host pools)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, List, Tuple

import grpc
import pytest

import kvcm
from conftest import Manager, Process, binary, prompt
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc

NS = kvcm.Namespace("acme", "deepseek-v3")
AGENTS = ("gpu0", "gpu1")


class Agent:
    """A kvcm-agent's BlockAgent, spoken to with the generated stubs (as a worker would)."""

    def __init__(self, agent_id: str, address: str) -> None:
        self.agent_id = agent_id
        self.channel = grpc.insecure_channel(address)
        self.stub = agent_pb2_grpc.BlockAgentStub(self.channel)

    def epoch(self) -> int:
        return self.stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=5).epoch

    def allocate(self, count: int, ns: kvcm.Namespace) -> Tuple[List[int], int]:
        """`count` blocks for `ns`, written whole (zeros), as a worker's are before its
        insert: the agent commits only blocks whose every byte was written."""
        stats = self.stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=5)
        request = agent_pb2.AllocateBlocksRequest(count=count, owner_epoch=stats.epoch)
        request.namespace.tenant, request.namespace.model = ns.tenant, ns.model
        allocated = self.stub.Allocate(request, timeout=5)
        ids = list(allocated.block_ids)
        header = agent_pb2.WriteBlocksHeader(block_ids=ids, owner_epoch=stats.epoch,
                                             block_generations=allocated.block_generations)
        total, chunk = len(ids) * stats.geometry.bytes_per_block, 1 << 20
        self.stub.WriteBlocks(iter([agent_pb2.WriteBlocksRequest(header=header)] +
                                   [agent_pb2.WriteBlocksRequest(data=bytes(min(chunk, total - at)))
                                    for at in range(0, total, chunk)]), timeout=30)
        return ids, stats.epoch

    def free_blocks(self) -> int:
        return self.stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=5).free_blocks


@pytest.fixture
def cluster(manager_factory, workdir: Path) -> Iterator[Tuple[Manager, kvcm.Client, dict]]:
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    manager = manager_factory().start()
    procs = []
    for agent_id in AGENTS:
        procs.append(
            Process(
                [
                    agent_bin,
                    "--insecure",
                    f"--agent_id={agent_id}",
                    f"--manager_address={manager.address}",
                    "--model=deepseek-v3",
                    "--capacity_bytes=100000000",
                    "--heartbeat_interval_ms=200",
                ],
                workdir / f"{agent_id}.log",
            )
        )
    client = kvcm.Client(manager.address, insecure=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            stats = client.stats()
            live = {a.agent_id: a for a in stats.agents if a.alive and a.block_agent_address}
            if len(live) == len(AGENTS):
                break
            assert time.monotonic() < deadline, f"agents did not register: {stats.agents}"
            time.sleep(0.05)
        agents = {a: Agent(a, live[a].block_agent_address) for a in AGENTS}
        client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        yield manager, client, agents
    finally:
        client.close()
        for p in procs:
            p.stop()


def test_insert_commits_through_the_agent(cluster) -> None:
    _, client, agents = cluster
    gpu0 = agents["gpu0"]
    tokens = prompt(300)
    free = gpu0.free_blocks()
    blocks, epoch = gpu0.allocate(4, NS)
    # A stale epoch is ABORTED and changes nothing.
    with pytest.raises(kvcm.Aborted):
        client.insert(NS, tokens, "gpu0", blocks, agent_epoch=epoch + 1)
    # Blocks never allocated to the namespace: the agent refuses (FAILED_PRECONDITION, not a
    # stale hash key: the client must not re-register and resend).
    other, _ = gpu0.allocate(4, kvcm.Namespace("acme", "other"))
    calls = client.counters.calls
    with pytest.raises(kvcm.FailedPrecondition, match="block_ids"):
        client.insert(NS, tokens, "gpu0", other, agent_epoch=epoch)
    assert client.counters.calls == calls + 1
    assert client.match(NS, tokens).matched_pages == 0

    ins = client.insert(NS, tokens, "gpu0", blocks, agent_epoch=epoch)
    assert ins.new_pages == 4
    m = client.match(NS, tokens, requester_agent_id="gpu0")
    assert m.local_pages == 4 and [p[0].block_id for p in m.pages] == blocks
    assert gpu0.free_blocks() == free - 8


def test_route_ranks_the_agent_holding_the_prefix(cluster) -> None:
    _, client, agents = cluster
    tokens = prompt(300)
    blocks, epoch = agents["gpu0"].allocate(4, NS)
    client.insert(NS, tokens, "gpu0", blocks, agent_epoch=epoch)
    before = client.stats().counters

    route = client.route(NS, tokens, candidates=["gpu1", "gpu0"], probe=True)
    assert [r.agent_id for r in route.ranked] == ["gpu0", "gpu1"]
    best, other = route.ranked
    assert (best.cached_pages, best.recompute_pages, best.fetch_pages) == (4, 0, 0)
    assert other.cached_pages == 0 and other.fetch_pages + other.recompute_pages == 4
    assert best.saved_prefill_ms > other.saved_prefill_ms
    assert route.match.local_pages == 4 and route.match.pin_id == 0
    assert client.stats().counters == before  # a probe changes nothing

    loaded = client.route(
        NS,
        tokens,
        candidates=[kvcm.RouteCandidate("gpu0", load=10), kvcm.RouteCandidate("gpu1", load=1)],
        policy=kvcm.RoutePolicy.LEAST_LOADED,
        probe=True,
    )
    assert [(r.agent_id, r.load) for r in loaded.ranked] == [("gpu1", 1), ("gpu0", 10)]

    # Every live agent when no candidates are given; queued prefill counts against gpu0.
    busy = client.route(
        NS,
        tokens,
        candidates=[kvcm.RouteCandidate("gpu0", queued_prefill_tokens=10**9), "gpu1"],
        probe=True,
    )
    assert busy.ranked[0].agent_id == "gpu1" and busy.ranked[1].queue_ms > 0
    assert {r.agent_id for r in client.route(NS, tokens, probe=True).ranked} == set(AGENTS)

    pinned = client.route(NS, tokens, candidates=["gpu0"], pin=True)
    assert pinned.match.pin_id != 0 and client.stats().active_pins == 1
    client.release(NS, pinned.match.pin_id)
    assert client.stats().active_pins == 0


def test_route_refusals(cluster) -> None:
    _, client, _ = cluster
    tokens = prompt(128)
    with pytest.raises(kvcm.NotFound):
        client.route(NS, tokens, candidates=["gpu9"])
    with pytest.raises(kvcm.InvalidArgument, match="candidates"):
        client.route(NS, tokens, candidates=["gpu0", "gpu0"])
    with pytest.raises(kvcm.InvalidArgument):
        client.route(NS, tokens, probe=True, pin=True)
    assert client.stats().active_pins == 0
