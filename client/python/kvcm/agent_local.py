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

This module never imports torch. Errors raise the kvcm.KvcmError subclass of the reply's
code, as every gRPC call of the client does. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from typing import Optional, Sequence, Union

import grpc

from kvcm._proto.v1 import common_pb2, local_pb2
from kvcm.errors import KvcmError, error_for
from kvcm.types import Namespace

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# Replies are small (a code, a message, a few numbers).
_MAX_REPLY_BYTES = 64 << 10


class LocalRegion:
    """A memfd region of `region_bytes` registered with the agent at `socket_path`.

    Engine block b's segment s lives at byte segment_offsets[s] + b * segment_stride of the
    region; an agent block is its segments end to end (len(segment_offsets) x segment_bytes
    must be the agent's bytes_per_block). The memfd is sealed against shrinking, which the
    agent requires. `buffer` is the region (a writable mmap: torch.frombuffer wraps it).
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
        self._fd = os.memfd_create("kvcm-engine-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, region_bytes)
            # Allocated now (it is the engine's KV memory): the agent maps an allocated region
            # with its page tables filled (a sparse one page by page, on first copy).
            os.posix_fallocate(self._fd, 0, region_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            self._map = mmap.mmap(self._fd, region_bytes, mmap.MAP_SHARED)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._sock.settimeout(timeout_s)
            self._sock.connect(socket_path)
            hello = local_pb2.LocalRequest()
            h = hello.hello
            h.token = token
            h.region_bytes = region_bytes
            h.segment_offsets.extend(segment_offsets)
            h.segment_bytes = segment_bytes
            h.segment_stride = segment_stride
            h.num_engine_blocks = num_engine_blocks
            reply = self._call(hello, fds=[self._fd])
        except BaseException:
            self.close()
            raise
        self.epoch: int = reply.epoch
        self.bytes_per_block: int = reply.bytes_per_block
        self.num_engine_blocks = num_engine_blocks

    @property
    def buffer(self) -> mmap.mmap:
        """The region, writable (torch.frombuffer(region.buffer, dtype=...) wraps it)."""
        return self._map

    def fileno(self) -> int:
        """The memfd (the engine may map it again, e.g. with other flags)."""
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
        m = getattr(self, "_map", None)
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


__all__ = ["LocalRegion"]
