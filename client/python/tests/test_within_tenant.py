"""Within a tenant (issue 35, deliverable 7), against a real kvcm-manager and kvcm-agent
with mutual TLS and tokens: two workers of tenant acme ("acme-a", "acme-b", each with its
own token) share the tenant's namespaces, but a block is committed only by the worker that
allocated it, and only once all its bytes were written. Each refused insert is checked for
its code, its reason, and that nothing was indexed or moved; the agent runs with
--verify_block_digests, so every load also checks the bytes against the commit's digest."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Dict, Iterator, List

import grpc
import pytest

import kvcm
from conftest import REPO_ROOT, Process, binary, free_port, prompt, scrape_metric, \
    wait_registered
from kvcm._proto.v1 import agent_pb2
from kvcm.agent import AgentSession, StagedBlocks

NS = kvcm.Namespace("acme", "tiny-gqa")
SPEC = kvcm.ModelSpec(attention=kvcm.AttentionKind.GQA, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, dtype=kvcm.KvDtype.BF16, page_size_tokens=16)
POOL = kvcm.PoolRef("gpu-0")
GRANTS = {"acme-a": "roles=worker tenant=acme", "acme-b": "roles=worker tenant=acme",
          "gpu-0": "roles=agent agent=gpu-0", "ops": "roles=admin"}


class Cluster:
    def __init__(self, manager_address: str, agent_address: str, metrics: str, certs: Path,
                 tokens: Dict[str, Path]) -> None:
        self.manager_address, self.agent_address = manager_address, agent_address
        self.metrics, self.certs, self.tokens = metrics, certs, tokens

    def client(self, who: str) -> kvcm.Client:
        return kvcm.Client(self.manager_address, tls_ca_file=str(self.certs / "ca.pem"),
                           tls_cert_file=str(self.certs / "client.pem"),
                           tls_key_file=str(self.certs / "client.key"),
                           token_file=str(self.tokens[who]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    manager_bin = binary("KVCM_MANAGER_BIN", "kvcm-manager")
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    workdir = tmp_path_factory.mktemp("within-tenant")
    certs = workdir / "certs"
    subprocess.run([str(REPO_ROOT / "scripts" / "make_test_certs.sh"), str(certs), "gpu-0"],
                   check=True, capture_output=True)
    tokens: Dict[str, Path] = {}
    lines = []
    for who, grant in GRANTS.items():
        token = secrets.token_hex(32)
        tokens[who] = workdir / f"{who}.token"
        tokens[who].write_text(token + "\n")
        lines.append(f"{hashlib.sha256(token.encode()).hexdigest()} {who} {grant}\n")
    table = workdir / "tokens"
    table.write_text("".join(lines))
    tls = [f"--tls_cert_file={certs / 'manager.pem'}", f"--tls_key_file={certs / 'manager.key'}",
           f"--tls_ca_file={certs / 'ca.pem'}"]
    manager_port, agent_port, metrics_port = free_port(), free_port(), free_port()
    manager = Process([manager_bin, f"--listen_address=127.0.0.1:{manager_port}",
                       "--metrics_address=", "--shutdown_grace_ms=100", f"--tokens_file={table}",
                       *tls], workdir / "manager.log",
                      dict(os.environ, KVCM_HASH_SECRET_HEX=secrets.token_hex(16)))
    agent = None
    try:
        manager.wait_for_log("kvcm-manager listening on")
        agent = Process([agent_bin, "--agent_id=gpu-0",
                         f"--manager_address=localhost:{manager_port}",
                         f"--listen_address=127.0.0.1:{agent_port}", "--use_device=false",
                         "--model=", "--attention=gqa", "--num_layers=2", "--num_heads=4",
                         "--num_kv_heads=2", "--head_dim=16", "--kv_dtype=bf16",
                         "--page_size_tokens=16", "--capacity_bytes=1048576",
                         "--heartbeat_interval_ms=200", "--verify_block_digests",
                         f"--metrics_address=127.0.0.1:{metrics_port}",
                         f"--tls_cert_file={certs / 'gpu-0.pem'}",
                         f"--tls_key_file={certs / 'gpu-0.key'}",
                         f"--tls_ca_file={certs / 'ca.pem'}",
                         f"--token_file={tokens['gpu-0']}", f"--tokens_file={table}"],
                        workdir / "agent.log")
        c = Cluster(f"localhost:{manager_port}", f"localhost:{agent_port}",
                    f"127.0.0.1:{metrics_port}", certs, tokens)
        with c.client("ops") as ops:
            wait_registered(ops, {"gpu-0": agent})
        yield c
    finally:
        if agent is not None:
            agent.stop()
        manager.stop()


def worker(cluster: Cluster, who: str):
    client = cluster.client(who)
    client.register_model(NS, SPEC)
    return client, AgentSession.of_client(client, cluster.agent_address)


def held_pages(cluster: Cluster, tokens: List[int]) -> int:
    with cluster.client("ops") as ops:
        return ops.match(NS, tokens, probe=True).matched_pages


def page_bytes(session: AgentSession, n: int, seed: int) -> List[bytes]:
    size = session.stats().geometry.bytes_per_block
    return [bytes([(seed + i) % 251]) * size for i in range(n)]


def test_a_worker_cannot_commit_blocks_another_worker_of_its_tenant_allocated(cluster) -> None:
    a, sa = worker(cluster, "acme-a")
    b, _ = worker(cluster, "acme-b")
    toks = prompt(32, seed=101)
    epoch = sa.epoch()
    alloc = sa.allocate(NS, 2, epoch)
    pages = page_bytes(sa, 2, 1)
    sa.write(alloc.block_ids, alloc.generations, pages, epoch)
    free_before = sa.stats().free_blocks
    # acme-b names acme-a's written blocks in its own insert (same tenant, same namespace).
    with pytest.raises(kvcm.PermissionDenied, match='allocated by principal "acme-a", not by '
                                                    '"acme-b"'):
        b.insert(NS, toks, POOL, alloc.block_ids, agent_epoch=epoch)
    assert held_pages(cluster, toks) == 0 and sa.stats().free_blocks == free_before
    # The blocks are still acme-a's, as it wrote them: it commits them and reads them back.
    result = sa.commit(a, StagedBlocks(NS, epoch, alloc.block_ids, alloc.generations), POOL, toks)
    assert result.stored_pages == 2 and held_pages(cluster, toks) == 2
    with b.match_and_pin(NS, toks) as prefix:  # acme-b loads what acme-a stored
        blocks = [replicas[0].block_id for replicas in prefix.match.pages]
        got = sa.read(NS, blocks, epoch=epoch, page_hashes=b.hash_prompt(NS, toks))
    assert blocks == alloc.block_ids and got == b"".join(pages)
    a.close()
    b.close()


def test_a_block_is_committed_only_once_all_its_bytes_are_written(cluster) -> None:
    a, sa = worker(cluster, "acme-a")
    toks = prompt(32, seed=202)
    epoch = sa.epoch()
    size = sa.stats().geometry.bytes_per_block
    alloc = sa.allocate(NS, 2, epoch)
    # Nothing written yet.
    with pytest.raises(kvcm.FailedPrecondition, match="has 0 of its .* bytes written"):
        a.insert(NS, toks, POOL, alloc.block_ids, agent_epoch=epoch)
    assert held_pages(cluster, toks) == 0

    # A write in flight: the stream has sent one block and half of the next when the insert
    # races it; the insert is refused, the stream then finishes, and the insert goes in.
    half_sent, finish = threading.Event(), threading.Event()
    pages = page_bytes(sa, 2, 7)

    def messages():
        yield agent_pb2.WriteBlocksRequest(header=agent_pb2.WriteBlocksHeader(
            block_ids=alloc.block_ids, owner_epoch=epoch, block_generations=alloc.generations))
        yield agent_pb2.WriteBlocksRequest(data=pages[0])
        yield agent_pb2.WriteBlocksRequest(data=pages[1][:size // 2])
        half_sent.set()
        finish.wait(30)
        yield agent_pb2.WriteBlocksRequest(data=pages[1][size // 2:])

    outcome: dict = {}
    writer = threading.Thread(target=lambda: outcome.update(
        written=sa._stub.WriteBlocks(messages(), timeout=60, metadata=sa._metadata)))
    writer.start()
    assert half_sent.wait(30)
    try:
        # The agent may not have received all the stream has sent (on a busy machine not even
        # block 0): whichever block it finds short first, the insert is refused.
        short = "|".join(f"block_ids\\[{i}\\]: block {b} has " for i, b in enumerate(alloc.block_ids))
        with pytest.raises(kvcm.FailedPrecondition, match=short):
            a.insert(NS, toks, POOL, alloc.block_ids, agent_epoch=epoch)
        assert held_pages(cluster, toks) == 0
    finally:
        finish.set()
        writer.join(60)
    assert outcome["written"].bytes_written == 2 * size
    a.insert(NS, toks, POOL, alloc.block_ids, agent_epoch=epoch)
    assert held_pages(cluster, toks) == 2
    hashes = a.hash_prompt(NS, toks)
    assert sa.read(NS, alloc.block_ids, epoch=epoch, page_hashes=hashes) == b"".join(pages)
    a.close()


def test_digests_are_taken_and_checked_and_nothing_changed_under_them(cluster) -> None:
    """Every load above went through the digest check (--verify_block_digests) and found
    the bytes as committed; the mismatch path is BlockPoolTest's (nothing outside the agent
    can write a committed block: that is the point)."""
    a, sa = worker(cluster, "acme-a")
    toks = prompt(48, seed=303)
    epoch = sa.epoch()
    pages = page_bytes(sa, 3, 11)
    stored = sa.store(a, NS, POOL, pages, toks)
    assert stored.stored_pages == 3
    hashes = a.hash_prompt(NS, toks)
    assert sa.read(NS, stored.block_ids, epoch=epoch, page_hashes=hashes) == b"".join(pages)
    assert scrape_metric(cluster.metrics, "kvcm_agent_digest_mismatches_total") == 0
    a.close()


def test_an_unauthenticated_caller_cannot_name_blocks_at_all(cluster) -> None:
    """Without a token the manager answers UNAUTHENTICATED before any commit is asked."""
    _, sa = worker(cluster, "acme-a")
    epoch = sa.epoch()
    alloc = sa.allocate(NS, 1, epoch)
    anonymous = kvcm.Client(cluster.manager_address, tls_ca_file=str(cluster.certs / "ca.pem"),
                            tls_cert_file=str(cluster.certs / "client.pem"),
                            tls_key_file=str(cluster.certs / "client.key"), token="")
    with pytest.raises((kvcm.Unauthenticated, grpc.RpcError)):
        anonymous.insert(NS, prompt(16, seed=404), POOL, alloc.block_ids, agent_epoch=epoch)
    anonymous.close()
