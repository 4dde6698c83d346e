"""kvcm.agent.AgentSession against a real kvcm-manager and two kvcm-agents (host pools of a
small MHA geometry): the store transaction commits, frees duplicates and frees everything on
failure (each agent's free block count is checked), reads are verified by the agent against
page hashes, chunked by the agent's own limits (gpu0 allows 4 blocks a call and 1 KiB
messages), Fetch pulls a replica, and a LocalRegion writes instead of WriteBlocks. Then the
same over mutual TLS with bearer tokens: a worker's token stores, a missing one or another
tenant's is refused and leaves nothing allocated."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

import kvcm
from conftest import REPO_ROOT, Process, binary, prompt, require_or_skip, wait_registered
from kvcm.agent import AgentSession, local_writer
from kvcm.agent_local import LocalRegion
from rigs.manager import ManagerProcess, free_port

NS = kvcm.Namespace("acme", "tiny")
PAGE = 4  # tokens per page
SPEC = kvcm.ModelSpec(attention=kvcm.AttentionKind.MHA, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=64, dtype=kvcm.KvDtype.BF16,
                      page_size_tokens=PAGE)
BLOCK = SPEC.bytes_per_page()  # 4096
# The agents' pools are host memory (--tier=host); an agent id alone names its GPU pool.
GPU0, GPU1 = kvcm.PoolRef("gpu0", kvcm.Tier.HOST), kvcm.PoolRef("gpu1", kvcm.Tier.HOST)
POOL_BLOCKS = 64
GEOMETRY = ["--model=", "--attention=mha", "--num_layers=2", "--num_heads=2",
            "--num_kv_heads=2", "--head_dim=64", "--kv_dtype=bf16",
            f"--page_size_tokens={PAGE}", f"--capacity_bytes={POOL_BLOCKS * BLOCK}",
            "--use_device=false", "--tier=host", "--heartbeat_interval_ms=200"]


def agent_args(agent_bin: str, agent_id: str, manager: str, port: int, *extra: str) -> List[str]:
    return [agent_bin, f"--agent_id={agent_id}", f"--manager_address={manager}",
            f"--listen_address=127.0.0.1:{port}", *GEOMETRY, *extra]


def pages(n: int) -> List[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


class Cluster:
    def __init__(self, client: kvcm.Client, agents: Dict[str, str], socket_path: str) -> None:
        self.client = client
        self.socket_path = socket_path
        self.sessions = {a: AgentSession.of_client(client, addr) for a, addr in agents.items()}

    def free(self, agent: str) -> int:
        return self.sessions[agent].stats().free_blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    manager_bin = binary("KVCM_MANAGER_BIN", "kvcm-manager")
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    workdir = tmp_path_factory.mktemp("agent-session")
    manager = ManagerProcess(manager_bin, workdir / "manager")
    procs: Dict[str, Process] = {}
    client = None
    socket_path = str(workdir / "gpu0.sock")
    try:
        manager.start()
        ports = {a: free_port() for a in ("gpu0", "gpu1")}
        procs["gpu0"] = Process(agent_args(agent_bin, "gpu0", manager.address, ports["gpu0"],
                                           "--insecure", "--max_blocks_per_call=4",
                                           "--max_message_bytes=1024", "--read_chunk_bytes=1000",
                                           f"--local_socket={socket_path}"),
                                workdir / "gpu0.log")
        procs["gpu1"] = Process(agent_args(agent_bin, "gpu1", manager.address, ports["gpu1"],
                                           "--insecure"), workdir / "gpu1.log")
        client = kvcm.Client(manager.address, insecure=True)
        wait_registered(client, procs)
        client.register_model(NS, SPEC)
        c = Cluster(client, {a: f"127.0.0.1:{p}" for a, p in ports.items()}, socket_path)
        yield c
        for s in c.sessions.values():
            s.close()
    finally:
        if client is not None:
            client.close()
        for p in procs.values():
            p.stop()
        manager.stop()


def test_store_commits_and_reads_back_verified(cluster: Cluster) -> None:
    gpu0, client = cluster.sessions["gpu0"], cluster.client
    tokens = prompt(10 * PAGE, seed=1)
    data = pages(10)
    free = cluster.free("gpu0")
    # 10 pages through an agent that takes 4 blocks a call and 1 KiB messages.
    stored = gpu0.store(client, NS, GPU0, data, tokens)
    assert gpu0.max_blocks_per_call == 4 and gpu0.max_message_bytes == 1024
    assert (stored.stored_pages, stored.duplicate_pages) == (10, 0)
    assert stored.block_ids == stored.stored_block_ids and len(set(stored.block_ids)) == 10
    assert stored.insert.new_pages == 10
    assert cluster.free("gpu0") == free - 10
    match = client.match(NS, tokens, requester_agent_id="gpu0", probe=True)
    assert match.local_pages == 10
    assert [p[0].block_id for p in match.pages] == stored.block_ids
    hashes = client.hash_prompt(NS, tokens)
    epoch = gpu0.epoch()
    assert gpu0.read(NS, stored.block_ids, epoch=epoch, page_hashes=hashes) == b"".join(data)
    # Pages 10..12 after the 10 known ones: only the new pages are allocated and written.
    longer = tokens + prompt(3 * PAGE, seed=2)
    more = pages(3)
    stored2 = gpu0.store(client, NS, GPU0, more, longer, known_blocks=stored.block_ids)
    assert stored2.stored_pages == 3 and stored2.block_ids[:10] == stored.block_ids
    assert cluster.free("gpu0") == free - 13
    assert client.match(NS, longer, probe=True).matched_pages == 13
    assert gpu0.read(NS, stored2.block_ids[10:], epoch=epoch,
                     page_hashes=client.hash_prompt(NS, longer)[10:]) == b"".join(more)


def test_verified_read_refuses_a_wrong_page_hash(cluster: Cluster) -> None:
    gpu0, client = cluster.sessions["gpu0"], cluster.client
    tokens = prompt(2 * PAGE, seed=3)
    data = pages(2)
    stored = gpu0.store(client, NS, GPU0, data, tokens)
    hashes = client.hash_prompt(NS, tokens)
    epoch = gpu0.epoch()
    with pytest.raises(kvcm.Aborted, match="no longer holds page"):
        gpu0.read(NS, stored.block_ids, epoch=epoch, page_hashes=[hashes[0], bytes(16)])
    # Page 1's hash for block 0: the block holds page 0.
    with pytest.raises(kvcm.Aborted, match="no longer holds page"):
        gpu0.read(NS, stored.block_ids[:1], epoch=epoch, page_hashes=hashes[1:])
    with pytest.raises(kvcm.InvalidArgument, match="page_hashes"):
        gpu0.read(NS, stored.block_ids, epoch=epoch, page_hashes=hashes[:1])
    # Another namespace's view of the same block is refused as well.
    with pytest.raises(kvcm.KvcmError):
        gpu0.read(kvcm.Namespace("acme", "other"), stored.block_ids, epoch=epoch,
                  page_hashes=hashes)
    assert gpu0.read(NS, stored.block_ids, epoch=epoch,
                     page_hashes=b"".join(hashes)) == b"".join(data)


def test_a_second_writer_frees_its_duplicates(cluster: Cluster) -> None:
    gpu0, client = cluster.sessions["gpu0"], cluster.client
    tokens = prompt(3 * PAGE, seed=4)
    epoch = gpu0.epoch()
    free = cluster.free("gpu0")
    # Two workers copy the same prompt's pages at once; the first insert wins.
    first = gpu0.stage(NS, pages(3), epoch=epoch)
    second = gpu0.stage(NS, pages(3), epoch=epoch)
    assert cluster.free("gpu0") == free - 6
    won = gpu0.commit(client, first, GPU0, tokens)
    lost = gpu0.commit(client, second, GPU0, tokens)
    assert (won.stored_pages, won.duplicate_pages) == (3, 0)
    assert (lost.stored_pages, lost.duplicate_pages) == (0, 3)
    assert lost.insert.already_present_pages == 3
    assert lost.block_ids == won.block_ids == first.block_ids and lost.stored_block_ids == []
    assert cluster.free("gpu0") == free - 3  # the loser's blocks are free again
    # A longer prompt over the first 3 pages: those 3 are duplicates, the 2 after stored.
    longer = tokens + prompt(2 * PAGE, seed=5)
    mixed = gpu0.store(client, NS, GPU0, pages(5), longer)
    assert (mixed.stored_pages, mixed.duplicate_pages) == (2, 3)
    assert mixed.block_ids[:3] == won.block_ids and mixed.stored_block_ids == mixed.block_ids[3:]
    assert cluster.free("gpu0") == free - 5
    assert client.match(NS, longer, probe=True).matched_pages == 5


def test_a_failed_store_frees_every_block(cluster: Cluster) -> None:
    gpu0, client = cluster.sessions["gpu0"], cluster.client
    tokens = prompt(6 * PAGE, seed=6)
    free = cluster.free("gpu0")
    epoch = gpu0.epoch()
    # A page of the wrong size: WriteBlocks is refused after a first run of 4 was written.
    bad = pages(5) + [b"x" * (BLOCK - 1)]
    with pytest.raises(kvcm.InvalidArgument):
        gpu0.store(client, NS, GPU0, bad, tokens)
    assert cluster.free("gpu0") == free
    # The writer fails.

    def broken(ids, gens, items, epoch) -> None:
        raise RuntimeError("engine copy failed")

    with pytest.raises(RuntimeError, match="engine copy failed"):
        gpu0.store(client, NS, GPU0, pages(6), tokens, writer=broken)
    assert cluster.free("gpu0") == free
    # The manager refuses the insert: more whole pages in the prompt than blocks, or blocks
    # allocated in an epoch that is not the agent's.
    with pytest.raises(kvcm.InvalidArgument, match="one per whole page"):
        gpu0.store(client, NS, GPU0, pages(5), tokens)
    assert cluster.free("gpu0") == free
    with pytest.raises(kvcm.Aborted, match="agent_epoch"):
        gpu0.store(client, NS, GPU0, pages(6), tokens, epoch=epoch + 1)
    assert cluster.free("gpu0") == free
    # An allocation past the pool's size is refused and allocates nothing.
    with pytest.raises(kvcm.ResourceExhausted, match="asked for 65 blocks"):
        gpu0.store(client, NS, GPU0, pages(POOL_BLOCKS + 1),
                   prompt((POOL_BLOCKS + 1) * PAGE, seed=7))
    assert cluster.free("gpu0") == free
    assert client.match(NS, tokens, probe=True).matched_pages == 0


def test_fetch_makes_a_replica_the_reader_verifies(cluster: Cluster) -> None:
    gpu0, gpu1, client = cluster.sessions["gpu0"], cluster.sessions["gpu1"], cluster.client
    tokens = prompt(3 * PAGE, seed=8)
    data = pages(3)
    src = gpu0.store(client, NS, GPU0, data, tokens)
    hashes = client.hash_prompt(NS, tokens)
    free = cluster.free("gpu1")
    fetched = gpu1.fetch(client, NS, hashes, source_agent_id="gpu0",
                         source_tier=int(kvcm.Tier.HOST), source_block_ids=src.block_ids)
    assert fetched.fetched_pages == 3 and fetched.bytes == 3 * BLOCK
    assert cluster.free("gpu1") == free - 3
    assert client.match(NS, tokens, requester_agent_id="gpu1", probe=True).local_pages == 3
    assert gpu1.read(NS, fetched.block_ids, epoch=gpu1.epoch(),
                     page_hashes=hashes) == b"".join(data)
    with pytest.raises(kvcm.NotFound):
        gpu1.fetch(client, NS, hashes, source_agent_id="gpu9", source_tier=int(kvcm.Tier.HOST),
                   source_block_ids=src.block_ids)
    assert cluster.free("gpu1") == free - 3


def test_a_local_region_writes_instead_of_write_blocks(cluster: Cluster) -> None:
    gpu0, client = cluster.sessions["gpu0"], cluster.client
    tokens = prompt(6 * PAGE, seed=9)
    with LocalRegion(cluster.socket_path, 8 * BLOCK, segment_offsets=[0], segment_bytes=BLOCK,
                     segment_stride=BLOCK, num_engine_blocks=8) as region:
        data = pages(6)
        engine_blocks = [7, 2, 5, 0, 1, 3]
        for b, page in zip(engine_blocks, data):
            region.buffer[b * BLOCK:(b + 1) * BLOCK] = page
        stored = gpu0.store(client, NS, GPU0, engine_blocks, tokens,
                            writer=local_writer(region))
        assert stored.stored_pages == 6
        assert gpu0.read(NS, stored.block_ids, epoch=region.epoch,
                         page_hashes=client.hash_prompt(NS, tokens)) == b"".join(data)


# ---- mutual TLS and tokens --------------------------------------------------------------


@pytest.fixture
def secured(workdir: Path) -> Iterator[dict]:
    manager_bin = binary("KVCM_MANAGER_BIN", "kvcm-manager")
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    certs = workdir / "certs"
    try:
        subprocess.run([str(REPO_ROOT / "scripts" / "make_test_certs.sh"), str(certs), "gpu0"],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        require_or_skip(f"scripts/make_test_certs.sh failed: {e}")
    tokens = {who: secrets.token_hex(16) for who in ("acme", "globex", "gpu0", "ops")}
    grants = {"acme": "acme roles=worker tenant=acme", "globex": "globex roles=worker tenant=globex",
              "gpu0": "gpu0 roles=agent agent=gpu0", "ops": "ops roles=admin"}
    table = workdir / "tokens"
    table.write_text("".join(f"{hashlib.sha256(tokens[w].encode()).hexdigest()} {grants[w]}\n"
                             for w in tokens))
    for who, token in tokens.items():
        (workdir / f"{who}.token").write_text(token + "\n")
    manager = ManagerProcess(manager_bin, workdir / "manager", tokens={
        tokens[w]: grants[w] for w in tokens},
        tls=(str(certs / "manager.pem"), str(certs / "manager.key"), str(certs / "ca.pem")))
    port = free_port()
    agent = None
    try:
        manager.start()
        agent = Process(agent_args(agent_bin, "gpu0", manager.address, port,
                                   f"--tls_cert_file={certs / 'gpu0.pem'}",
                                   f"--tls_key_file={certs / 'gpu0.key'}",
                                   f"--tls_ca_file={certs / 'ca.pem'}",
                                   f"--token_file={workdir / 'gpu0.token'}",
                                   f"--tokens_file={table}"), workdir / "gpu0.log")

        def client(who: str = "") -> kvcm.Client:
            return kvcm.Client(manager.address, tls_ca_file=str(certs / "ca.pem"),
                               tls_cert_file=str(certs / "client.pem"),
                               tls_key_file=str(certs / "client.key"),
                               token_file=str(workdir / f"{who}.token") if who else None)

        with client("ops") as ops:
            deadline = time.monotonic() + 20
            while not any(a.alive for a in ops.stats().agents):
                assert agent.proc.poll() is None, agent.log.read_text()
                assert time.monotonic() < deadline, agent.log.read_text()
                time.sleep(0.1)
        yield {"client": client, "agent": f"127.0.0.1:{port}"}
    finally:
        if agent is not None:
            agent.stop()
        manager.stop()


def test_store_and_read_over_mutual_tls_with_tokens(secured, monkeypatch) -> None:
    monkeypatch.delenv("KVCM_TOKEN", raising=False)
    tokens = prompt(3 * PAGE, seed=10)
    data = pages(3)
    with secured["client"]("acme") as acme, \
            AgentSession.of_client(acme, secured["agent"]) as gpu0:
        acme.register_model(NS, SPEC)
        free = gpu0.stats().free_blocks
        stored = gpu0.store(acme, NS, GPU0, data, tokens)
        assert stored.stored_pages == 3 and gpu0.stats().free_blocks == free - 3
        assert gpu0.read(NS, stored.block_ids, epoch=gpu0.epoch(),
                         page_hashes=acme.hash_prompt(NS, tokens)) == b"".join(data)
        epoch = gpu0.epoch()
        # No token: the agent refuses before anything is allocated.
        with secured["client"]() as anonymous, \
                AgentSession.of_client(anonymous, secured["agent"]) as stranger:
            with pytest.raises(kvcm.Unauthenticated, match=f"agent {secured['agent']}"):
                stranger.allocate(NS, 2, epoch)
            with pytest.raises(kvcm.Unauthenticated):
                stranger.read(NS, stored.block_ids, epoch=epoch,
                              page_hashes=acme.hash_prompt(NS, tokens))
        # Another tenant's worker may neither allocate in acme's namespace nor read it.
        with secured["client"]("globex") as globex, \
                AgentSession.of_client(globex, secured["agent"]) as intruder:
            with pytest.raises(kvcm.PermissionDenied):
                intruder.allocate(NS, 2, epoch)
            with pytest.raises(kvcm.PermissionDenied):
                intruder.read(NS, stored.block_ids, epoch=epoch,
                              page_hashes=acme.hash_prompt(NS, tokens))
        assert gpu0.stats().free_blocks == free - 3
    # Plaintext to a TLS agent: UNAVAILABLE with a hint.
    with kvcm.Client("127.0.0.1:1", insecure=True) as plain, \
            AgentSession.of_client(plain, secured["agent"], timeout_s=3) as session:
        with pytest.raises(kvcm.Unavailable, match="may require TLS"):
            session.epoch()
