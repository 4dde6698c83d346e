"""What an inference worker asks of its kvcm-agent's BlockAgent (the Python twin of
client/agent_blocks.h): allocate blocks for a namespace, write and read them, pull pages other
agents hold (Fetch), free blocks the manager did not keep, and the store transaction that
puts new pages into the cache (docs/AGENTS.md, "A worker's request, end to end"):

    session = AgentSession.of_client(client, "10.0.0.5:50061")   # the client's TLS and token
    pool = kvcm.PoolRef("gpu0", kvcm.Tier.GPU)                   # the agent's id and --tier
    stored = session.store(client, ns, pool, pages, tokens=prompt, known_blocks=held)
    data = session.read(ns, stored.block_ids, epoch=session.epoch(),
                        page_hashes=client.hash_prompt(ns, prompt))

Store: Allocate the new pages' blocks for the namespace in the agent's epoch, write them
(WriteBlocks, or a caller's writer such as a kvcm.agent_local.LocalRegion copy), Insert the
prompt at the manager (which commits the blocks through the agent's ledger), then free the
blocks of pages another writer stored meanwhile (duplicates). A failure anywhere frees every
block of the transaction before it raises. stage() and commit() are its two halves, for a
caller that copies now and inserts later (vLLM's kv_both) or inserts pages one by one.

Bytes in, bytes out: no torch, so every engine adapter shares it. Errors raise the
kvcm.KvcmError subclass of the agent's status code, naming the agent and the call.
Thread-safe: one AgentSession may be shared by any number of threads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Union

import grpc

from kvcm._options import ClientOptions, channel_credentials, channel_options, tls_mismatch_hint
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc
from kvcm.errors import Internal, InvalidArgument, KvcmError, error_for
from kvcm.types import (
    PENDING_BLOCK_ID,
    InsertResult,
    Namespace,
    NamespaceLike,
    PoolLike,
    Tier,
    as_namespace,
)

logger = logging.getLogger(__name__)

PAGE_HASH_BYTES = 16
# The agent's defaults (--max_blocks_per_call, --max_message_bytes), until stats() reads
# its own.
DEFAULT_MAX_BLOCKS_PER_CALL = 64
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
# gRPC's own cap on a message this channel receives (a ReadBlocks chunk is 1 MiB by default).
_CHANNEL_MESSAGE_BYTES = 64 << 20

BytesLike = Union[bytes, bytearray, memoryview]
PageHashes = Union[BytesLike, Sequence[bytes]]
# writer(block_ids, generations, items, epoch) fills blocks block_ids[i] with items[i]; called
# once per run of at most max_blocks_per_call blocks. `items` is the slice of store()'s
# `pages` for those blocks: bytes for the default (WriteBlocks), or whatever the writer
# understands (e.g. engine block numbers for LocalRegion.store, see local_writer).
Writer = Callable[[List[int], List[int], Sequence[Any], int], None]


class Allocation(NamedTuple):
    block_ids: List[int]
    generations: List[int]  # of each block's allocation, parallel to block_ids


class Fetched(NamedTuple):
    block_ids: List[int]  # the local agent's block of each page [0, len(page_hashes))
    fetched_pages: int  # pulled from the source
    bytes: int  # moved


@dataclass(frozen=True)
class StagedBlocks:
    """Blocks allocated to `ns` in the agent's `epoch` and written, not yet inserted: the
    caller's to commit() or free()."""

    ns: Namespace
    epoch: int
    block_ids: List[int]
    generations: List[int]

    def part(self, start: int, stop: int) -> "StagedBlocks":
        """Blocks [start, stop): e.g. one page committed as its own prompt."""
        return StagedBlocks(self.ns, self.epoch, self.block_ids[start:stop],
                            self.generations[start:stop])

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class StoreResult:
    """What a store put into the cache. Pages [0, len(block_ids)) of the prompt: the known
    pages', then the new pages'."""

    # The pool's block of each page as the index holds it: a duplicate's is the block
    # another writer stored it in.
    block_ids: List[int] = field(default_factory=list)
    # New pages indexed in this store's blocks, and their blocks (the rest were freed).
    stored_pages: int = 0
    stored_block_ids: List[int] = field(default_factory=list)
    # New pages another writer had stored meanwhile: this store's copies were freed.
    duplicate_pages: int = 0
    insert: Optional[InsertResult] = None  # None when nothing was inserted (no new page)


def local_writer(region: Any) -> Writer:
    """A store() writer that copies engine blocks into the new agent blocks through a
    kvcm.agent_local.LocalRegion (the agent's --local_socket): store()'s `pages` are then
    the engine's block numbers."""

    def write(block_ids: List[int], generations: List[int], engine_blocks: Sequence[Any],
              epoch: int) -> None:
        region.store(block_ids, list(engine_blocks), owner_epoch=epoch, generations=generations)

    return write


def _joined_hashes(page_hashes: PageHashes, count: int) -> bytes:
    wire = (bytes(page_hashes) if isinstance(page_hashes, (bytes, bytearray, memoryview))
            else b"".join(bytes(h) for h in page_hashes))
    if len(wire) != count * PAGE_HASH_BYTES:
        raise InvalidArgument(f"page_hashes: {len(wire)} bytes for {count} blocks "
                              f"({PAGE_HASH_BYTES} each)")
    return wire


class AgentSession:
    """A worker's connection to one kvcm-agent's BlockAgent, with a kvcm.Client's TLS
    credentials and bearer token (options: ca_file, cert_file, key_file or insecure; token).
    Every call runs under `timeout_s` unless it is given its own; none is retried."""

    def __init__(self, address: str, options: ClientOptions, *, timeout_s: float = 10.0) -> None:
        if not address or ":" not in address:
            raise InvalidArgument(f"agent_address {address!r}: must be host:port")
        if not timeout_s > 0:
            raise InvalidArgument("timeout_s: must be > 0")
        self.address = address
        self.timeout_s = timeout_s
        self._insecure = options.insecure
        self._metadata = (("authorization", f"Bearer {options.token}"),) if options.token else ()
        grpc_options = channel_options(options) + [
            ("grpc.max_receive_message_length", _CHANNEL_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _CHANNEL_MESSAGE_BYTES)]
        creds = channel_credentials(options)
        self._channel = (grpc.insecure_channel(address, options=grpc_options) if creds is None
                         else grpc.secure_channel(address, creds, options=grpc_options))
        self._stub = agent_pb2_grpc.BlockAgentStub(self._channel)
        # The agent's limits and block size, from stats() (asked by the first call that
        # needs them).
        self.max_blocks_per_call = DEFAULT_MAX_BLOCKS_PER_CALL
        self.max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self.bytes_per_block = 0
        self._limits_known = False

    @classmethod
    def of_client(cls, client: Any, address: str, *, timeout_s: float = 10.0) -> "AgentSession":
        """A session with `client`'s (a kvcm.Client) credentials and token."""
        return cls(address, client.options, timeout_s=timeout_s)

    # ---- plumbing ------------------------------------------------------------------------

    def _error(self, method: str, e: grpc.RpcError) -> KvcmError:
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = (e.details() if callable(getattr(e, "details", None)) else None) or str(e)
        message = f"agent {self.address}: {method}: {details}"
        if code == grpc.StatusCode.UNAVAILABLE:
            message += tls_mismatch_hint(details, self._insecure)
        return error_for(code, message)

    def _unary(self, method: str, request: Any, timeout_s: Optional[float]) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s,
                                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(method, e) from None

    def _batches(self, count: int) -> Iterator[slice]:
        if not self._limits_known:
            self.stats()
        step = max(1, self.max_blocks_per_call)
        for start in range(0, count, step):
            yield slice(start, min(start + step, count))

    # ---- calls ---------------------------------------------------------------------------

    def stats(self, *, timeout_s: Optional[float] = None) -> agent_pb2.BlockAgentStatsResponse:
        """The agent's epoch, geometry, usage and stream limits (which this session adopts)."""
        stats = self._unary("Stats", agent_pb2.BlockAgentStatsRequest(), timeout_s)
        limits = stats.stream_limits
        if limits.max_blocks_per_call:
            self.max_blocks_per_call = limits.max_blocks_per_call
        if limits.max_message_bytes:
            self.max_message_bytes = limits.max_message_bytes
        self.bytes_per_block = stats.geometry.bytes_per_block
        self._limits_known = True
        return stats

    def epoch(self, *, timeout_s: Optional[float] = None) -> int:
        """The agent's epoch: blocks for the cache are allocated in it. A restarted agent has
        a new one (and none of the old blocks): ask again after a failure."""
        return self.stats(timeout_s=timeout_s).epoch

    def allocate(self, ns: NamespaceLike, count: int, epoch: int, *,
                 timeout_s: Optional[float] = None) -> Allocation:
        """`count` blocks for `ns` in `epoch`, all or none (a full pool first has the manager
        evict: AGENTS.md "A store into a full pool")."""
        namespace = as_namespace(ns)
        request = agent_pb2.AllocateBlocksRequest(count=count, owner_epoch=epoch)
        request.namespace.tenant, request.namespace.model = namespace.tenant, namespace.model
        response = self._unary("Allocate", request, timeout_s)
        return Allocation(list(response.block_ids), list(response.block_generations))

    def write(self, block_ids: Sequence[int], generations: Sequence[int],
              pages: Sequence[BytesLike], epoch: int, *,
              timeout_s: Optional[float] = None) -> int:
        """Fills block_ids[i] with pages[i] (each exactly bytes_per_block), one WriteBlocks
        per max_blocks_per_call blocks, each page sent in pieces of at most
        max_message_bytes; returns the bytes written. `pages` is indexed one run at a time,
        so a lazy sequence holds one run's bytes at once. A failed run leaves the runs
        before it written (the blocks stay the caller's: free them)."""
        if not len(block_ids) == len(generations) == len(pages):
            raise InvalidArgument(f"write: {len(block_ids)} blocks, {len(generations)} "
                                  f"generations, {len(pages)} pages")
        written = 0
        for run in self._batches(len(block_ids)):
            piece = max(1, self.max_message_bytes)
            ids, gens = list(block_ids[run]), list(generations[run])

            def messages(ids: List[int] = ids, gens: List[int] = gens, first: int = run.start,
                         piece: int = piece) -> Iterator[agent_pb2.WriteBlocksRequest]:
                yield agent_pb2.WriteBlocksRequest(header=agent_pb2.WriteBlocksHeader(
                    block_ids=ids, owner_epoch=epoch, block_generations=gens))
                for j in range(len(ids)):
                    data = memoryview(pages[first + j]).cast("B")  # type: ignore[arg-type]
                    for at in range(0, len(data), piece):
                        yield agent_pb2.WriteBlocksRequest(data=bytes(data[at:at + piece]))

            written += self._unary("WriteBlocks", messages(), timeout_s).bytes_written
        return written

    def read(self, ns: NamespaceLike, block_ids: Sequence[int], *, epoch: int,
             page_hashes: PageHashes, tier: int = int(Tier.UNSPECIFIED),
             timeout_s: Optional[float] = None) -> bytes:
        """The bytes of block_ids, in order, if each still holds page page_hashes[i] of `ns`
        (16 bytes each, joined or a sequence): the agent checks under the lock of the copy
        that reads it, so a block whose pin was lost and that went to another page is
        kvcm.Aborted ("no longer holds page"), never another page's bytes. One ReadBlocks
        per max_blocks_per_call blocks; `tier` is the pool (0: the agent's main pool)."""
        namespace = as_namespace(ns)
        hashes = _joined_hashes(page_hashes, len(block_ids))
        out = bytearray()
        for run in self._batches(len(block_ids)):
            request = agent_pb2.ReadBlocksRequest(
                block_ids=list(block_ids[run]), owner_epoch=epoch, tier=tier,
                page_hashes=hashes[run.start * PAGE_HASH_BYTES:run.stop * PAGE_HASH_BYTES])
            request.namespace.tenant, request.namespace.model = namespace.tenant, namespace.model
            try:
                for chunk in self._stub.ReadBlocks(request, timeout=timeout_s or self.timeout_s,
                                                   metadata=self._metadata):
                    out += chunk.data
            except grpc.RpcError as e:
                raise self._error("ReadBlocks", e) from None
        if len(out) != self.bytes_per_block * len(block_ids):
            raise Internal(f"agent {self.address}: ReadBlocks returned {len(out)} bytes for "
                           f"{len(block_ids)} blocks of {self.bytes_per_block}")
        return bytes(out)

    def fetch(self, client: Any, ns: NamespaceLike, page_hashes: Sequence[bytes], *,
              source_agent_id: str, source_block_ids: Sequence[int],
              source_tier: int = int(Tier.UNSPECIFIED), local_block_ids: Sequence[int] = (),
              tier: int = int(Tier.UNSPECIFIED),
              timeout_s: Optional[float] = None) -> Fetched:
        """Pulls pages [len(local_block_ids), len(page_hashes)) of the prompt from
        `source_agent_id`'s blocks into this agent's pool `tier`, which indexes them as a new
        replica before answering (BlockAgent.Fetch). `local_block_ids`: this agent's blocks
        of the pages before them. `client` (a kvcm.Client that registered `ns`) gives the
        prompt's hash scheme. NotFound for a source the manager does not know."""
        namespace = as_namespace(ns)
        hashes = list(page_hashes)
        request = agent_pb2.FetchRequest(
            prompt=client.hashed_prompt(namespace, hashes), local_block_ids=list(local_block_ids),
            source_agent_id=source_agent_id, source_tier=source_tier,
            source_block_ids=list(source_block_ids), tier=tier)
        request.namespace.tenant, request.namespace.model = namespace.tenant, namespace.model
        response = self._unary("Fetch", request, timeout_s)
        if len(response.block_ids) < len(hashes):
            raise Internal(f"agent {self.address}: Fetch answered {len(response.block_ids)} "
                           f"blocks for {len(hashes)} pages")
        return Fetched(list(response.block_ids), response.fetched_pages, response.bytes)

    def free(self, block_ids: Sequence[int], generations: Sequence[int], epoch: int, *,
             timeout_s: Optional[float] = None) -> bool:
        """Frees blocks this worker allocated and the manager did not index; best effort:
        False (logged) when the agent refused or could not be reached (cache blocks it
        never hears of again are freed after its allocation_ttl_ms)."""
        if not block_ids:
            return True
        try:
            self._unary("Free", agent_pb2.FreeBlocksRequest(
                block_ids=list(block_ids), owner_epoch=epoch,
                block_generations=list(generations)), timeout_s)
            return True
        except KvcmError as e:
            logger.info("kvcm agent: free of %d blocks failed: %s", len(block_ids), e)
            return False

    # ---- the store transaction -----------------------------------------------------------

    def stage(self, ns: NamespaceLike, pages: Sequence[Any], *, epoch: int,
              writer: Optional[Writer] = None,
              timeout_s: Optional[float] = None) -> StagedBlocks:
        """Allocates one block per page for `ns` in the agent's `epoch` and fills them:
        with `writer` (see Writer), else WriteBlocks of `pages` (bytes each). A failure
        frees the blocks, then raises."""
        namespace = as_namespace(ns)
        if not len(pages):
            return StagedBlocks(namespace, epoch, [], [])
        ids, gens = self.allocate(namespace, len(pages), epoch, timeout_s=timeout_s)
        try:
            if writer is None:
                self.write(ids, gens, pages, epoch, timeout_s=timeout_s)
            else:
                for run in self._batches(len(ids)):
                    writer(ids[run], gens[run], pages[run], epoch)
        except BaseException:
            self.free(ids, gens, epoch, timeout_s=timeout_s)
            raise
        return StagedBlocks(namespace, epoch, ids, gens)

    def commit(self, client: Any, staged: StagedBlocks, pool: PoolLike, tokens: Any = None, *,
               page_hashes: Optional[PageHashes] = None, known_blocks: Sequence[int] = (),
               deadline_ms: Optional[int] = None) -> StoreResult:
        """Inserts the prompt (`tokens` or `page_hashes`, exactly len(known_blocks) +
        len(staged) whole pages) into `pool` (this agent's pool: kvcm.PoolRef(agent_id,
        tier); an agent id alone names its GPU pool) with `known_blocks` (the pool's blocks of the leading pages, already indexed) then
        the staged blocks, through `client` (a kvcm.Client that registered staged.ns); then
        frees the staged blocks of pages the pool already held under another block (another
        writer stored them meanwhile). A failed Insert frees every staged block, then
        raises."""
        known = list(known_blocks)
        if not staged.block_ids:
            return StoreResult(block_ids=known)
        try:
            result = client.insert(staged.ns, tokens, pool, known + staged.block_ids,
                                   page_hashes=page_hashes, agent_epoch=staged.epoch,
                                   deadline_ms=deadline_ms)
        except BaseException:
            self.free(staged.block_ids, staged.generations, staged.epoch)
            raise
        present = len(known)
        existing = result.existing_block_ids
        blocks = list(known)
        kept: List[int] = []
        dup_ids: List[int] = []
        dup_gens: List[int] = []
        for k, (block, generation) in enumerate(zip(staged.block_ids, staged.generations)):
            page = present + k
            if page < result.already_present_pages and (page >= len(existing)
                                                        or existing[page] != block):
                dup_ids.append(block)
                dup_gens.append(generation)
                blocks.append(existing[page] if page < len(existing) else PENDING_BLOCK_ID)
            else:
                kept.append(block)
                blocks.append(block)
        self.free(dup_ids, dup_gens, staged.epoch)
        return StoreResult(block_ids=blocks, stored_pages=len(kept), stored_block_ids=kept,
                           duplicate_pages=len(dup_ids), insert=result)

    def store(self, client: Any, ns: NamespaceLike, pool: PoolLike, pages: Sequence[Any],
              tokens: Any = None, *, page_hashes: Optional[PageHashes] = None,
              known_blocks: Sequence[int] = (), epoch: Optional[int] = None,
              writer: Optional[Writer] = None, deadline_ms: Optional[int] = None,
              timeout_s: Optional[float] = None) -> StoreResult:
        """Stores pages [len(known_blocks), len(known_blocks) + len(pages)) of the prompt
        (`tokens` or `page_hashes`) into new blocks of this agent's pool `pool` and indexes
        them: stage() then commit(). `epoch`: the agent's (asked when None). Nothing is left
        allocated when it raises; pages another writer stored meanwhile come back as
        duplicate_pages, their blocks freed."""
        if epoch is None:
            epoch = self.epoch(timeout_s=timeout_s)
        staged = self.stage(ns, pages, epoch=epoch, writer=writer, timeout_s=timeout_s)
        return self.commit(client, staged, pool, tokens, page_hashes=page_hashes,
                           known_blocks=known_blocks, deadline_ms=deadline_ms)

    def free_staged(self, staged: StagedBlocks) -> bool:
        """Frees staged blocks that will not be committed (best effort)."""
        return self.free(staged.block_ids, staged.generations, staged.epoch)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "AgentSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AgentSession", "Allocation", "Fetched", "StagedBlocks", "StoreResult",
           "local_writer"]
