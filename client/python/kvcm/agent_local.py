"""The engine's end of a kvcm-agent's local data path (docs/AGENTS.md "Local data path").

An engine on the agent's host keeps its KV blocks in a region of shared memory it owns (a
memfd) and registers it with the agent over the agent's Unix socket (``--local_socket``);
the agent then copies whole blocks between its pool and the region itself, one memcpy per
segment, with the checks of ReadBlocks (load) and WriteBlocks (store). The engine never maps
the agent's pool.

    region = LocalRegion("/run/kvcm/agent.sock", region_bytes,
                         segment_offsets=[l * layer_bytes for l in range(layers)],
                         segment_bytes=block_bytes_per_layer,
                         segment_stride=block_bytes_per_layer,
                         num_engine_blocks=num_blocks, token=token)
    kv = torch.frombuffer(region.buffer, dtype=torch.uint8)   # the engine's KV tensors
    region.store(block_ids, engine_blocks, owner_epoch=epoch, generations=gens)
    region.load(block_ids, engine_blocks, owner_epoch=epoch, namespace=ns, page_hashes=pages)

A GPU engine registers its device memory instead (CUDA IPC; the agent must be built with
CUDA and run on the engine's host): one CUDA IPC handle and offset per segment base, e.g.
from each layer's KV tensor at engine block 0:

    bus_id, segments = cuda_segments([kv[layer] for layer in range(layers)])
    region = LocalRegion.cuda("/run/kvcm/agent.sock", segments, pci_bus_id=bus_id,
                              segment_bytes=..., segment_stride=..., num_engine_blocks=...)
    torch.cuda.current_stream().synchronize()   # the KV is written before a store
    region.store(...)                           # loaded blocks are ready when load returns

This module imports torch only in cuda_segments. Errors raise the kvcm.KvcmError subclass
of the reply's code, as every gRPC call of the client does. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import grpc

from kvcm._proto.v1 import common_pb2, local_pb2
from kvcm.errors import KvcmError, error_for
from kvcm.types import Namespace

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# Replies are small (a code, a message, a few numbers).
_MAX_REPLY_BYTES = 64 << 10

# sizeof(cudaIpcMemHandle_t).
CUDA_IPC_HANDLE_BYTES = 64


class CudaSegment(NamedTuple):
    """Where one segment of engine block 0 lives in a GPU engine's memory: the CUDA IPC
    handle (64 bytes, cudaIpcGetMemHandle) of the allocation that holds it and its byte
    offset from that allocation's base (not from the tensor's data_ptr: PyTorch's caching
    allocator places tensors inside larger allocations)."""

    handle: bytes
    offset: int


def cuda_ipc_handle(handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t in a handle torch's ``_share_cuda_`` returns: recent torch
    releases put a version byte and a type byte before it (type ``c``: a cudaMalloc block).
    A 64-byte handle is returned as it is. ValueError for an expandable segment's handle
    (type ``e``, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which is not a CUDA
    IPC handle."""
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return bytes(handle[2:])
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError(
            "the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which CUDA IPC handles cannot export; allocate the KV "
            "cache without expandable segments"
        )
    raise ValueError(f"not a CUDA IPC memory handle: {len(handle)} bytes")


def cuda_segments(
    tensors: Sequence[Any], pci_bus_id: Optional[str] = None
) -> Tuple[str, List[CudaSegment]]:
    """For torch CUDA tensors, one per segment, each starting at that segment of engine block
    0 (e.g. each layer's KV tensor, or its K and V halves), on one device: that device's PCI
    bus id (`pci_bus_id` when given, else torch's device properties) and each tensor's
    CudaSegment. Imports torch.

    torch's ``_share_cuda_`` marks each storage as shared with another process (torch's own
    CUDA IPC bookkeeping). Keep the tensors, and so their memory, alive while the region is
    registered: CUDA leaves freeing memory another process still has open undefined."""
    import torch

    if not tensors:
        raise ValueError("cuda_segments: no tensors")
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"cuda_segments: tensors must be on one CUDA device, got {devices}")
    bus_id = pci_bus_id
    if bus_id is None:
        props = torch.cuda.get_device_properties(next(iter(devices)))
        if not hasattr(props, "pci_bus_id"):
            raise ValueError("this torch does not report the device's PCI bus id: pass pci_bus_id")
        bus_id = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    segments = []
    for t in tensors:
        share = t.untyped_storage()._share_cuda_()
        # (device, handle, storage_size_bytes, storage_offset_bytes, ...): the storage's
        # offset from its allocation's base, to which the tensor's own offset adds.
        handle, storage_offset_bytes = share[1], share[3]
        segments.append(
            CudaSegment(
                cuda_ipc_handle(handle),
                storage_offset_bytes + t.storage_offset() * t.element_size(),
            )
        )
    return bus_id, segments


class LocalRegion:
    """A memfd region of `region_bytes` registered with the agent at `socket_path`.

    Engine block b's segment s lives at byte segment_offsets[s] + b * segment_stride of the
    region; an agent block is its segments end to end (len(segment_offsets) x segment_bytes
    must be the agent's bytes_per_block). The memfd is allocated and sealed against
    shrinking, which the agent requires; the agent then seals it with F_SEAL_FUTURE_WRITE, so
    holes cannot be punched in it, nor new writable mappings made. `buffer` is the region (a
    writable mmap made before the hello: torch.frombuffer wraps it).
    """

    def __init__(
        self,
        socket_path: str,
        region_bytes: int,
        *,
        segment_offsets: Sequence[int],
        segment_bytes: int,
        segment_stride: int,
        num_engine_blocks: int,
        token: str = "",
        timeout_s: Optional[float] = 30.0,
    ) -> None:
        self._sock: Optional[socket.socket] = None
        self._map: Optional[mmap.mmap] = None
        self._fd = os.memfd_create("kvcm-engine-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, region_bytes)
            # Allocated now (it is the engine's KV memory), as the agent requires: it refuses a
            # region with holes, which its copies would allocate on the agent's account.
            os.posix_fallocate(self._fd, 0, region_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self._map = mmap.mmap(self._fd, region_bytes, mmap.MAP_SHARED)
            hello = _hello(token, region_bytes, segment_offsets, segment_bytes, segment_stride,
                           num_engine_blocks)
            self._connect(socket_path, timeout_s, hello, [self._fd])
        except BaseException:
            self.close()
            raise

    @classmethod
    def cuda(
        cls,
        socket_path: str,
        segments: Sequence[CudaSegment],
        *,
        pci_bus_id: str,
        segment_bytes: int,
        segment_stride: int,
        num_engine_blocks: int,
        region_bytes: int = 0,
        token: str = "",
        timeout_s: Optional[float] = 30.0,
    ) -> "LocalRegion":
        """Registers a GPU engine's KV memory by CUDA IPC (cuda_segments makes the arguments
        from torch tensors): engine block b's segment s lives at segments[s].offset + b *
        segment_stride of the allocation segments[s].handle names, on the device at
        `pci_bus_id` ("0000:3b:00.0"). `region_bytes` bounds every segment's end from its
        allocation's base (0: the furthest end the layout reaches). The agent opens the
        handles once and copies with cudaMemcpy; it refuses with kvcm.FailedPrecondition when
        it was built without CUDA or has no device, kvcm.InvalidArgument naming the field for
        a bad handle or layout. The region has no host buffer.

        Ordering is the engine's: synchronize the stream that wrote the KV before a store,
        and read loaded blocks only after load returns; a load that raises may have written
        part of its engine blocks: treat them all as not loaded."""
        self = cls.__new__(cls)
        self._sock = None
        self._map = None
        self._fd = -1
        offsets = [s.offset for s in segments]
        if region_bytes == 0 and offsets:
            region_bytes = max(offsets) + (num_engine_blocks - 1) * segment_stride + segment_bytes
        hello = _hello(token, region_bytes, offsets, segment_bytes, segment_stride,
                       num_engine_blocks)
        hello.hello.cuda_ipc.pci_bus_id = pci_bus_id
        hello.hello.cuda_ipc.segment_handles.extend(s.handle for s in segments)
        try:
            self._connect(socket_path, timeout_s, hello, [])
        except BaseException:
            self.close()
            raise
        return self

    def _connect(
        self,
        socket_path: str,
        timeout_s: Optional[float],
        hello: local_pb2.LocalRequest,
        fds: Sequence[int],
    ) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        self._sock.connect(socket_path)
        reply = self._call(hello, fds=fds)
        self.epoch: int = reply.epoch
        self.bytes_per_block: int = reply.bytes_per_block
        self.num_engine_blocks: int = hello.hello.num_engine_blocks

    @property
    def buffer(self) -> mmap.mmap:
        """The region, writable (torch.frombuffer(region.buffer, dtype=...) wraps it)."""
        if self._map is None:
            raise ValueError("a CUDA region has no host buffer")
        return self._map

    def fileno(self) -> int:
        """The memfd (the engine may map it again, read-only: the agent sealed it with
        F_SEAL_FUTURE_WRITE at the hello)."""
        if self._fd < 0:
            raise ValueError("a CUDA region has no memfd")
        return self._fd

    def load(
        self,
        block_ids: Sequence[int],
        engine_blocks: Sequence[int],
        *,
        owner_epoch: int,
        tier: int = 0,
        generations: Sequence[int] = (),
        namespace: Optional[Namespace] = None,
        page_hashes: Union[None, bytes, Sequence[bytes]] = None,
    ) -> int:
        """Copies agent blocks block_ids[i] into engine blocks engine_blocks[i]; returns how
        many. With `namespace` and `page_hashes` (16 bytes per block), every block must still
        hold that page (kvcm.Aborted otherwise, and nothing is copied)."""
        req = self._copy(local_pb2.LOCAL_DIRECTION_LOAD, block_ids, engine_blocks, owner_epoch,
                         tier, generations)
        if namespace is not None:
            req.copy.namespace.CopyFrom(
                common_pb2.Namespace(tenant=namespace.tenant, model=namespace.model)
            )
        if page_hashes is not None:
            req.copy.page_hashes = (
                page_hashes if isinstance(page_hashes, bytes) else b"".join(page_hashes)
            )
        return self._call(req).blocks_copied

    def store(
        self,
        block_ids: Sequence[int],
        engine_blocks: Sequence[int],
        *,
        owner_epoch: int,
        generations: Sequence[int],
        tier: int = 0,
    ) -> int:
        """Copies engine blocks engine_blocks[i] into agent blocks block_ids[i] (allocated to
        owner_epoch, not committed; `generations` as Allocate returned them); returns how
        many."""
        req = self._copy(local_pb2.LOCAL_DIRECTION_STORE, block_ids, engine_blocks, owner_epoch,
                         tier, generations)
        return self._call(req).blocks_copied

    def close(self) -> None:
        """Hangs up (the agent unmaps the region) and releases the memfd and the mapping.
        The mapping is closed only when no exported buffer (e.g. a tensor) still uses it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        m = self._map
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # a tensor still views it; it is unmapped when that goes
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "LocalRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _copy(
        direction: int,
        block_ids: Sequence[int],
        engine_blocks: Sequence[int],
        owner_epoch: int,
        tier: int,
        generations: Sequence[int],
    ) -> local_pb2.LocalRequest:
        req = local_pb2.LocalRequest()
        c = req.copy
        c.direction = direction
        c.tier = tier
        c.owner_epoch = owner_epoch
        c.block_ids.extend(block_ids)
        c.engine_blocks.extend(engine_blocks)
        c.block_generations.extend(generations)
        return req

    def _call(self, req: local_pb2.LocalRequest, fds: Sequence[int] = ()) -> local_pb2.LocalReply:
        if self._sock is None:
            raise KvcmError("the local session is closed", grpc.StatusCode.FAILED_PRECONDITION)
        data = req.SerializeToString()
        try:
            if fds:
                socket.send_fds(self._sock, [data], list(fds))
            else:
                self._sock.send(data)
            raw = self._sock.recv(_MAX_REPLY_BYTES)
        except OSError as e:
            raise error_for(grpc.StatusCode.UNAVAILABLE, f"local socket: {e}") from e
        if not raw:
            raise error_for(grpc.StatusCode.UNAVAILABLE, "local socket: the agent hung up")
        reply = local_pb2.LocalReply.FromString(raw)
        if reply.code != 0:
            code = _BY_NUMBER.get(reply.code, grpc.StatusCode.UNKNOWN)
            raise error_for(code, reply.message)
        return reply


def _hello(
    token: str,
    region_bytes: int,
    segment_offsets: Sequence[int],
    segment_bytes: int,
    segment_stride: int,
    num_engine_blocks: int,
) -> local_pb2.LocalRequest:
    req = local_pb2.LocalRequest()
    h = req.hello
    h.token = token
    h.region_bytes = region_bytes
    h.segment_offsets.extend(segment_offsets)
    h.segment_bytes = segment_bytes
    h.segment_stride = segment_stride
    h.num_engine_blocks = num_engine_blocks
    return req


__all__ = ["CudaSegment", "LocalRegion", "cuda_ipc_handle", "cuda_segments"]
