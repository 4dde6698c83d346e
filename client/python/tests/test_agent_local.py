"""The agent's local data path: a real kvcm-agent with --local_socket and a real manager. The
engine's memfd region is registered (kvcm.agent_local.LocalRegion), blocks allocated over
gRPC are stored with one local STORE, loaded back with a local LOAD into other engine blocks
and read with gRPC ReadBlocks: the same bytes every way."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import grpc
import pytest

import kvcm
from conftest import Process, binary, prompt
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc
from kvcm.agent_local import CudaSegment, LocalRegion, cuda_ipc_handle, cuda_segments

NS = kvcm.Namespace("acme", "deepseek-v3")
ENGINE_BLOCKS = 6


class Rig:
    def __init__(self, client: kvcm.Client, address: str, socket_path: str) -> None:
        self.client = client
        self.socket_path = socket_path
        self.channel = grpc.insecure_channel(address)
        self.stub = agent_pb2_grpc.BlockAgentStub(self.channel)
        stats = self.stub.Stats(agent_pb2.BlockAgentStatsRequest(), timeout=5)
        self.epoch = stats.epoch
        g = stats.geometry
        self.layers = g.spec.num_layers
        self.bytes_per_block = g.bytes_per_block

    def allocate(self, count: int) -> Tuple[List[int], List[int]]:
        req = agent_pb2.AllocateBlocksRequest(count=count, owner_epoch=self.epoch)
        req.namespace.tenant, req.namespace.model = NS.tenant, NS.model
        resp = self.stub.Allocate(req, timeout=5)
        return list(resp.block_ids), list(resp.block_generations)

    def read_blocks(self, ids: List[int], **extra) -> bytes:
        req = agent_pb2.ReadBlocksRequest(block_ids=ids, owner_epoch=self.epoch, **extra)
        return b"".join(chunk.data for chunk in self.stub.ReadBlocks(req, timeout=10))

    def region(self) -> LocalRegion:
        """A vLLM-CPU-like layout: per layer a [ENGINE_BLOCKS, segment] tensor."""
        seg = self.bytes_per_block // self.layers
        return LocalRegion(
            self.socket_path,
            self.layers * ENGINE_BLOCKS * seg,
            segment_offsets=[layer * ENGINE_BLOCKS * seg for layer in range(self.layers)],
            segment_bytes=seg,
            segment_stride=seg,
            num_engine_blocks=ENGINE_BLOCKS,
        )


def engine_block(region: LocalRegion, layers: int, b: int) -> bytes:
    """Engine block b as an agent block: its layer segments end to end."""
    seg = region.bytes_per_block // layers
    buf = region.buffer
    return b"".join(
        buf[layer * ENGINE_BLOCKS * seg + b * seg : layer * ENGINE_BLOCKS * seg + (b + 1) * seg]
        for layer in range(layers)
    )


def fill_engine_block(region: LocalRegion, layers: int, b: int, data: bytes) -> None:
    seg = region.bytes_per_block // layers
    for layer in range(layers):
        start = layer * ENGINE_BLOCKS * seg + b * seg
        region.buffer[start : start + seg] = data[layer * seg : (layer + 1) * seg]


@pytest.fixture
def rig(manager_factory, workdir: Path) -> Iterator[Rig]:
    agent_bin = binary("KVCM_AGENT_BIN", "kvcm-agent")
    manager = manager_factory().start()
    socket_path = str(workdir / "agent.sock")
    proc = Process(
        [
            agent_bin,
            "--insecure",
            "--agent_id=gpu0",
            f"--manager_address={manager.address}",
            "--model=deepseek-v3",
            "--capacity_bytes=100000000",
            "--heartbeat_interval_ms=200",
            f"--local_socket={socket_path}",
        ],
        workdir / "gpu0.log",
    )
    client = kvcm.Client(manager.address, insecure=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            live = [a for a in client.stats().agents if a.alive and a.block_agent_address]
            if live and os.path.exists(socket_path):
                break
            assert time.monotonic() < deadline, "the agent did not register"
            time.sleep(0.05)
        client.register_model(NS, kvcm.ModelSpec.deepseek_v3())
        yield Rig(client, live[0].block_agent_address, socket_path)
    finally:
        client.close()
        proc.stop()
    assert not os.path.exists(socket_path), "the agent left its socket behind"


def test_store_then_load_and_read_blocks_agree(rig: Rig) -> None:
    assert stat.S_IMODE(os.stat(rig.socket_path).st_mode) == 0o600
    ids, gens = rig.allocate(3)
    with rig.region() as region:
        assert region.bytes_per_block == rig.bytes_per_block
        assert region.epoch == rig.epoch
        blocks = [os.urandom(rig.bytes_per_block) for _ in ids]
        for b, data in enumerate(blocks):
            fill_engine_block(region, rig.layers, b, data)
        assert region.store(ids, [0, 1, 2], owner_epoch=rig.epoch, generations=gens) == 3
        # Back into engine blocks 5, 4, 3 of the same region, and into another region.
        assert region.load(ids, [5, 4, 3], owner_epoch=rig.epoch) == 3
        for i, b in enumerate([5, 4, 3]):
            assert engine_block(region, rig.layers, b) == blocks[i]
    with rig.region() as other:
        assert other.load(ids[::-1], [0, 1, 2], owner_epoch=rig.epoch, generations=gens[::-1]) == 3
        assert engine_block(other, rig.layers, 0) == blocks[2]
        assert engine_block(other, rig.layers, 2) == blocks[0]
    assert rig.read_blocks(ids) == b"".join(blocks)


def test_refusals_copy_nothing(rig: Rig) -> None:
    ids, gens = rig.allocate(2)
    with rig.region() as region:
        data = os.urandom(rig.bytes_per_block)
        fill_engine_block(region, rig.layers, 0, data)
        # A STORE into a block freed since (its generation ended); a LOAD past the engine
        # blocks.
        freed, freed_gens = rig.allocate(1)
        rig.stub.Free(
            agent_pb2.FreeBlocksRequest(
                block_ids=freed, block_generations=freed_gens, owner_epoch=rig.epoch
            ),
            timeout=5,
        )
        with pytest.raises(kvcm.Aborted):
            region.store(freed, [0], owner_epoch=rig.epoch, generations=freed_gens)
        with pytest.raises(kvcm.InvalidArgument, match="engine_blocks"):
            region.load(ids[:1], [ENGINE_BLOCKS], owner_epoch=rig.epoch)
        assert region.store(ids, [0, 1], owner_epoch=rig.epoch, generations=gens) == 2

        # Committed through the manager: immutable, and readable only as the pages it holds.
        tokens = prompt(64 * 2)
        assert rig.client.insert(NS, tokens, "gpu0", ids, agent_epoch=rig.epoch).new_pages == 2
        with pytest.raises(kvcm.FailedPrecondition):
            region.store(ids[:1], [1], owner_epoch=rig.epoch, generations=gens[:1])
        before = bytes(region.buffer)
        wrong = [bytes(16), bytes(range(16))]
        with pytest.raises(kvcm.Aborted, match="no longer holds page"):
            region.load(ids, [1, 2], owner_epoch=rig.epoch, namespace=NS, page_hashes=wrong)
        assert bytes(region.buffer) == before
        with pytest.raises(grpc.RpcError) as e:
            req = agent_pb2.ReadBlocksRequest(
                block_ids=ids, owner_epoch=rig.epoch, page_hashes=b"".join(wrong)
            )
            req.namespace.tenant, req.namespace.model = NS.tenant, NS.model
            list(rig.stub.ReadBlocks(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.ABORTED
        # Without a page check it still reads what it stored.
        assert region.load(ids[:1], [3], owner_epoch=rig.epoch) == 1
        assert engine_block(region, rig.layers, 3) == data


def test_a_hello_must_carry_a_sealed_memfd(rig: Rig, tmp_path: Path) -> None:
    import socket

    from kvcm._proto.v1 import local_pb2

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(rig.socket_path)
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, rig.bytes_per_block)
    req = local_pb2.LocalRequest()
    h = req.hello
    h.region_bytes = rig.bytes_per_block
    h.segment_offsets.append(0)
    h.segment_bytes = rig.bytes_per_block
    h.num_engine_blocks = 1
    socket.send_fds(sock, [req.SerializeToString()], [fd])
    reply = local_pb2.LocalReply.FromString(sock.recv(65536))
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sealed" in reply.message
    os.close(fd)
    sock.close()


def test_cuda_ipc_handles_from_torch_are_unwrapped() -> None:
    raw = bytes(range(64))
    assert cuda_ipc_handle(raw) == raw
    assert cuda_ipc_handle(b"\x03c" + raw) == raw  # torch 2.13: version 3, a cudaMalloc block
    with pytest.raises(ValueError, match="expandable"):
        cuda_ipc_handle(b"\x03e" + raw + bytes(40))
    with pytest.raises(ValueError, match="10 bytes"):
        cuda_ipc_handle(bytes(10))


def test_a_cuda_hello_to_an_agent_without_cuda_is_refused_with_the_reason(rig: Rig) -> None:
    """This agent (a CPU build, or no device) cannot open CUDA IPC handles: the hello is
    FAILED_PRECONDITION saying why, registers nothing, and the connection can still register
    a memfd. A handle of the wrong size is INVALID_ARGUMENT naming it."""
    import fcntl
    import socket

    from kvcm._proto.v1 import local_pb2

    seg = rig.bytes_per_block // rig.layers
    segments = [CudaSegment(bytes(64), layer * ENGINE_BLOCKS * seg) for layer in range(rig.layers)]
    kwargs = dict(
        pci_bus_id="0000:00:00.0",
        segment_bytes=seg,
        segment_stride=seg,
        num_engine_blocks=ENGINE_BLOCKS,
    )
    with pytest.raises(kvcm.FailedPrecondition, match="built without CUDA|no CUDA device"):
        LocalRegion.cuda(rig.socket_path, segments, **kwargs)
    bad = list(segments)
    bad[1] = CudaSegment(bytes(66), bad[1].offset)
    with pytest.raises(kvcm.InvalidArgument, match=r"cuda_ipc\.segment_handles\[1\]"):
        LocalRegion.cuda(rig.socket_path, bad, **kwargs)

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(rig.socket_path)
    req = local_pb2.LocalRequest()
    h = req.hello
    h.region_bytes = rig.bytes_per_block
    h.segment_offsets.append(0)
    h.segment_bytes = rig.bytes_per_block
    h.num_engine_blocks = 1
    h.cuda_ipc.pci_bus_id = "0000:00:00.0"
    h.cuda_ipc.segment_handles.append(bytes(64))
    sock.send(req.SerializeToString())
    reply = local_pb2.LocalReply.FromString(sock.recv(65536))
    assert reply.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], reply.message
    # The same connection then registers a memfd.
    h.ClearField("cuda_ipc")
    fd = os.memfd_create("kv", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, rig.bytes_per_block)
    os.posix_fallocate(fd, 0, rig.bytes_per_block)  # the agent refuses holes
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    socket.send_fds(sock, [req.SerializeToString()], [fd])
    reply = local_pb2.LocalReply.FromString(sock.recv(65536))
    assert reply.code == 0, reply.message
    assert reply.bytes_per_block == rig.bytes_per_block
    os.close(fd)
    sock.close()


def test_a_gpu_engine_stores_and_loads_by_cuda_ipc(rig: Rig) -> None:
    """Needs torch with a CUDA device and an agent built with CUDA on the same host: one
    tensor per layer (as vLLM allocates), registered by CUDA IPC; blocks stored, loaded back
    into other engine blocks and read over gRPC agree bit for bit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    seg = rig.bytes_per_block // rig.layers
    layers = [
        torch.randint(0, 256, (ENGINE_BLOCKS, seg), dtype=torch.uint8, device="cuda")
        for _ in range(rig.layers)
    ]
    torch.cuda.synchronize()  # the KV is written before the agent reads it
    bus_id, segments = cuda_segments(layers)
    ids, gens = rig.allocate(2)
    with LocalRegion.cuda(
        rig.socket_path,
        segments,
        pci_bus_id=bus_id,
        segment_bytes=seg,
        segment_stride=seg,
        num_engine_blocks=ENGINE_BLOCKS,
    ) as region:
        assert region.bytes_per_block == rig.bytes_per_block
        assert region.store(ids, [4, 1], owner_epoch=rig.epoch, generations=gens) == 2
        want = [b"".join(bytes(t[b].cpu().tolist()) for t in layers) for b in (4, 1)]
        assert rig.read_blocks(ids) == b"".join(want)
        assert region.load(ids, [0, 5], owner_epoch=rig.epoch) == 2
        for t in layers:
            assert torch.equal(t[0], t[4]) and torch.equal(t[5], t[1])
