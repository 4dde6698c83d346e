"""The worker half of kvcm's vLLM connector (in each of vLLM's worker processes, one per
rank): registers vLLM's KV tensors (the layout check, the namespace, the local region),
loads the pages the scheduler half matched before the forward (fetching those other agents
hold first), and stores the whole pages a step computed after it. Every agent call is
bounded by agent_deadline_ms."""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch

import kvcm
from kvcm.agent import AgentSession, local_writer
from kvcm.errors import DeadlineExceeded, Unavailable
from kvcm.vllm.config import (HOST_TIER, MAX_BLOCKS_PER_CALL, ConnectorOptions, Shard,
                              logger, register, tensor_parallel_rank, unsupported_kv_cache)
from kvcm.vllm.layout import BlockBytes, KvBlocks, block_views
from kvcm.vllm.metadata import FetchRun, KvcmConnectorMetadata, LoadSpec, StoreSpec

if TYPE_CHECKING:
    from kvcm.agent_local import LocalRegion
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# A kv_both store's Insert, run by the background inserter, ms.
_BACKGROUND_INSERT_DEADLINE_MS = 5_000


class _Background:
    """One thread that runs jobs in the order they were submitted; join() returns once every
    job submitted so far has run. A job's exception is logged, never raised."""

    def __init__(self, name: str, what: str) -> None:
        self._what = what
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def join(self) -> None:
        self._queue.join()  # every job is bounded by its agent or manager deadline

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                work()
            except Exception as e:  # noqa: BLE001 - a failed store only costs a later hit
                logger.warning("KvcmConnector: background %s failed: %s", self._what, e)
            finally:
                self._queue.task_done()

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


def layer_tensors(layer: Any) -> List[Tuple[str, Optional[int], torch.Tensor]]:
    """The KV tensors an attention layer reads: its kv_cache attribute, a tensor or a list
    of them (one per virtual engine in some vLLM versions)."""
    value = getattr(layer, "kv_cache", None)
    if isinstance(value, torch.Tensor):
        return [("kv_cache", None, value)]
    if isinstance(value, (list, tuple)):
        return [("kv_cache", i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)
                and v.numel() > 0]
    return []


@dataclass
class BoundView:
    """A layer's view of one of the connector's KV tensors: `size`/`stride` elements from
    `offset` elements past the tensor's start."""

    layer: Any
    attr: str
    index: Optional[int]
    tensor: torch.Tensor
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int


def rebind(views: List[BoundView]) -> None:
    """Points each layer's view at its tensor's current memory (after Tensor.set_)."""
    for v in views:
        view = torch.as_strided(v.tensor, v.size, v.stride, v.tensor.storage_offset() + v.offset)
        if v.index is None:
            setattr(v.layer, v.attr, view)
        else:
            getattr(v.layer, v.attr)[v.index] = view


class ConnectorWorker:
    """One per worker process (tensor-parallel rank); vLLM calls it from one thread."""

    def __init__(self, opts: ConnectorOptions, client: kvcm.Client, spec: kvcm.ModelSpec,
                 shards: List[Shard], vllm_config: "VllmConfig",
                 kv_cache_config: "Optional[KVCacheConfig]", loads: bool):
        self._opts, self._client, self._spec = opts, client, spec
        self._vllm_config, self._kv_cache_config = vllm_config, kv_cache_config
        self._block_size = vllm_config.cache_config.block_size
        self._loads_kv = loads
        self.rank = tensor_parallel_rank()
        # The worker's own page set; MLA: every rank reads rank 0's, only rank 0 stores.
        self._shard = self.rank if len(shards) > 1 else 0
        self.stores_here = len(shards) > 1 or self.rank == 0
        mine = shards[self._shard]
        self._ns, self._agent_id = mine.namespace, mine.agent_id
        self._agent_address, self._local_socket = mine.agent_address, mine.local_socket
        self._token = client.options.token  # token_file's, else $KVCM_TOKEN's
        self._kv_caches: List[Tuple[str, torch.Tensor]] = []
        # vLLM's blocks as bytes (register_kv_caches); block_bytes is one agent block.
        self._blocks: Optional[KvBlocks] = None
        self._load_errors: Set[int] = set()
        self._agent: Optional[AgentSession] = None
        self._agent_quiet_until = 0.0  # see _epoch
        # Local agent blocks (main pool) of each running request's leading pages: what a
        # later step's store names for the pages before its own.
        self._agent_blocks: Dict[str, List[int]] = {}
        # kv_both: the copies of a step's stores run here while vLLM samples and schedules,
        # joined before the next step's forward can write a block (see wait_for_save); the
        # manager Inserts run on the inserter, never joined.
        self._copier: Optional[_Background] = None
        self._inserter: Optional[_Background] = None
        self._region: Optional["LocalRegion"] = None

    def __str__(self) -> str:
        return (f"rank {self.rank}, namespace {self._ns}, agent {self._agent_id} at "
                f"{self._agent_address}, spec {self._spec}"
                + ("" if self.stores_here else " (loads only: rank 0 stores the latents)"))

    def _loads(self) -> bool:
        return self._loads_kv

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        # Layer order = model order (vLLM's names end ".layers.<i>.self_attn.attn").
        def layer_index(name: str) -> Tuple[int, str]:
            digits = [p for p in name.split(".") if p.isdigit()]
            return (int(digits[0]) if digits else 0, name)

        ordered = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        if (reason := unsupported_kv_cache(ordered)) is not None:
            raise ValueError(reason)
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        self._kv_caches, layout = block_views(ordered, num_blocks, self._backend_name(ordered))
        self._blocks = KvBlocks([t for _, t in self._kv_caches], stage=self._opts.test_stage)
        per_block = self._blocks.block_bytes
        expected = (self._spec.bytes_per_token_per_layer() * self._spec.num_layers
                    * self._block_size)
        logger.info("KvcmConnector: %d KV layers, layer 0 shape %s stride %s dtype %s; "
                    "%d bytes per block (namespace spec: %d)", len(self._kv_caches),
                    tuple(self._kv_caches[0][1].shape), self._kv_caches[0][1].stride(),
                    self._kv_caches[0][1].dtype, per_block, expected)
        if per_block != expected:
            raise ValueError(f"KvcmConnector: vLLM's KV block is {per_block} bytes, namespace "
                             f"{self._ns}'s spec {self._spec} makes {expected}")
        self._spec = self._spec.with_(kv_layout=layout)
        register(self._client, self._ns, self._spec)
        self._connect()
        if self._blocks.staged:
            logger.info("KvcmConnector: KV on %s, staged through %s host memory on the gRPC "
                        "path", self._blocks.device,
                        "pinned" if self._blocks.device.type == "cuda" else "plain")
        if not self._local_socket:
            return
        if self._blocks.device.type != "cpu":
            logger.warning("KvcmConnector: local_socket not used, bytes go over gRPC: vLLM's "
                           "KV is on %s, and the local path maps host memory only",
                           self._blocks.device)
            return
        if any(t is not original for (_, t), (_, original) in zip(self._kv_caches, ordered)):
            logger.warning("KvcmConnector: local_socket not used, bytes go over gRPC: vLLM's "
                           "KV tensors are split into kernel blocks")
            return
        self._register_region()

    def _connect(self) -> None:
        """Connects to the agent now, at start, with a start-up deadline: the step's calls
        then find the channel ready instead of paying its connect within agent_deadline_ms
        (a first store on a loaded host was skipped when the connect alone took longer). An
        agent not up yet only costs a warning: the steps retry."""
        try:
            self._session().stats(timeout_s=max(30.0, self._opts.agent_deadline_ms / 1e3))
        except Exception as e:  # noqa: BLE001 - the engine starts without the agent
            logger.warning("KvcmConnector: agent %s at %s not reachable at start: %s",
                           self._agent_id, self._agent_address, e)

    def _backend_name(self, kv_caches: List[Tuple[str, torch.Tensor]]) -> str:
        """The attention backend of the first KV layer (part of the byte layout)."""
        context = self._vllm_config.compilation_config.static_forward_context
        layer = context.get(kv_caches[0][0]) if kv_caches else None
        backend = getattr(layer, "attn_backend", None)
        return backend.get_name() if backend is not None else "unknown"

    def _register_region(self) -> None:
        """Moves vLLM's KV tensors into one memfd region (each layer page-aligned) and
        registers it with the agent: from now on the agent copies blocks into and out of
        vLLM's cache itself. The tensors keep their identity (set_); a layer that bound its
        own view of one (vLLM's MLA layers bind kv_cache.squeeze(1)) is re-bound to the same
        view of the new memory. Then every tensor each attention layer reads must lie in the
        region; if any does not (a view this code cannot follow), the tensors go back and
        bytes travel over gRPC instead, with a warning: the agent would otherwise write
        memory attention never reads."""
        from kvcm.agent_local import LocalRegion

        layers = [t for _, t in self._kv_caches]
        for name, t in self._kv_caches:
            if not t.is_contiguous():  # a block-outermost layout: layers interleave
                logger.warning("KvcmConnector: local_socket not used, bytes go over gRPC: KV "
                               "layer %s is not contiguous (stride %s)", name, t.stride())
                return
        bound = self._bound_views()
        if isinstance(bound, str):
            logger.warning("KvcmConnector: local_socket not used, bytes go over gRPC: %s", bound)
            return
        sizes = [t.numel() * t.element_size() for t in layers]
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        segment = layers[0][0].numel() * layers[0].element_size()
        region = LocalRegion(self._local_socket, region_bytes=end,
                             segment_offsets=offsets, segment_bytes=segment,
                             segment_stride=segment, num_engine_blocks=layers[0].shape[0],
                             token=self._token)
        originals = [t.view(t.shape) for t in layers]  # keep the old memory until checked
        for t, offset in zip(layers, offsets):
            moved = torch.frombuffer(region.buffer, dtype=t.dtype, count=t.numel(),
                                     offset=offset).view(t.shape)
            moved.copy_(t)
            t.set_(moved)
        rebind(bound)
        base = layers[0].data_ptr() - offsets[0]
        outside = [f"{name}.{attr}" for name, layer in self._attention_layers()
                   for attr, _, v in layer_tensors(layer)
                   if not base <= v.data_ptr() < base + end]
        if outside:
            for t, old in zip(layers, originals):
                t.set_(old)
            rebind(bound)
            region.close()
            logger.warning("KvcmConnector: local_socket not used, bytes go over gRPC: after "
                           "the move, attention still reads memory outside the registered "
                           "region (%s)", ", ".join(outside[:4]))
            return
        self._region = region
        logger.info("KvcmConnector: vLLM's KV cache (%d bytes) is registered with the agent "
                    "at %s; %d layer views re-bound", end, self._local_socket, len(bound))

    def _attention_layers(self) -> List[Tuple[str, Any]]:
        """The attention layers vLLM bound our KV tensors to (its forward context)."""
        context = self._vllm_config.compilation_config.static_forward_context
        return [(name, context[name]) for name, _ in self._kv_caches if name in context]

    def _bound_views(self) -> Any:
        """Every tensor an attention layer reads that is a view of one of our KV tensors but
        not the tensor itself, as a BoundView; or a string: why the local path cannot be
        used (a layer reads memory that is none of our tensors, or a view of another
        dtype)."""
        ours = [t for _, t in self._kv_caches]
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t) for t in ours]
        views = []
        for name, layer in self._attention_layers():
            for attr, index, v in layer_tensors(layer):
                if any(v is t for t in ours):
                    continue
                owner = next((t for lo, hi, t in spans if lo <= v.data_ptr() < hi), None)
                if owner is None or v.dtype != owner.dtype:
                    return (f"layer {name}'s {attr} is not a view of the KV tensor vLLM "
                            "registered with the connector")
                offset = (v.data_ptr() - owner.data_ptr()) // owner.element_size()
                views.append(BoundView(layer, attr, index, owner, tuple(v.size()), v.stride(),
                                       offset))
        return views

    def _session(self) -> AgentSession:
        """This worker's agent (its rank's), with the client's TLS and token."""
        if self._agent is None:
            self._agent = AgentSession.of_client(self._client, self._agent_address,
                                                 timeout_s=self._opts.agent_deadline_ms / 1e3)
        return self._agent

    def _epoch(self) -> int:
        """The agent's epoch (asked once a step that moves blocks: a restarted agent has a
        new one, and its old blocks are gone). An agent that missed a deadline is not asked
        again for agent_deadline_ms: a silent agent costs one deadline per such window, not
        one per step (each step's load and store would otherwise wait it out in turn)."""
        if time.monotonic() < self._agent_quiet_until:
            raise Unavailable("the agent missed a deadline less than "
                                          f"{self._opts.agent_deadline_ms} ms ago")
        try:
            return self._session().epoch()
        except (DeadlineExceeded, Unavailable):
            self._agent_quiet_until = time.monotonic() + self._opts.agent_deadline_ms / 1e3
            raise

    def start_load_kv(self, meta: KvcmConnectorMetadata) -> None:
        # Before this step's forward (or a load) writes any block: the last step's stores
        # have read theirs, and a block they read may be another request's from now on.
        if self._copier is not None:
            self._copier.join()
        if not meta.loads:
            return
        try:
            epoch = self._epoch()
        except Exception as e:  # noqa: BLE001
            logger.warning("KvcmConnector: agent unreachable, recomputing: %s", e)
            for load in meta.loads:
                self._load_errors.update(load.vllm_blocks)
            return
        for load in meta.loads:
            try:
                self._load(load, epoch)
            except Exception as e:  # noqa: BLE001 - recompute those blocks
                logger.warning("KvcmConnector: load of %s failed, recomputing %d blocks: %s",
                               load.req_id, len(load.vllm_blocks), e)
                self._load_errors.update(load.vllm_blocks)

    def _load(self, load: LoadSpec, epoch: int) -> None:
        shard = load.shards[self._shard]
        blocks = list(shard.local_blocks)
        fetched = 0
        for run in shard.fetch:
            blocks = self._fetch(load.req_id, shard.page_hashes, run, blocks)
            fetched += len(run.source_blocks)
        self._agent_blocks[load.req_id] = [b for b, tier in blocks if tier != HOST_TIER]
        if self._opts.test_load_gate:
            self._wait_for_gate(load.req_id)
        end = load.first_page + len(load.vllm_blocks)
        if len(blocks) < end:
            raise RuntimeError(f"the agent holds {len(blocks)} of {end} pages")
        block_bytes = self._blocks.block_bytes
        start = time.perf_counter()
        page = load.first_page
        while page < end:
            # One ReadBlocks per run of pages in one tier, at most MAX_BLOCKS_PER_CALL.
            tier = blocks[page][1]
            stop = page
            while stop < end and stop - page < MAX_BLOCKS_PER_CALL and blocks[stop][1] == tier:
                stop += 1
            # With the pages' hashes, the agent checks under its lock that each block still
            # holds its page (a lost pin's block may hold another page by now).
            agent_ids = [b for b, _ in blocks[page:stop]]
            vllm_ids = load.vllm_blocks[page - load.first_page:stop - load.first_page]
            if self._region is not None:
                self._region.load(agent_ids, vllm_ids, owner_epoch=epoch, tier=tier,
                                  namespace=self._ns,
                                  page_hashes=b"".join(shard.page_hashes[page:stop]))
                page = stop
                continue
            data = self._session().read(self._ns, agent_ids,
                                        epoch=epoch, tier=tier,
                                        page_hashes=shard.page_hashes[page:stop])
            self._blocks.scatter(vllm_ids, data)
            page = stop
        seconds = time.perf_counter() - start
        logger.info("KvcmConnector: loaded %d blocks of %s (%d fetched from other agents): "
                    "%d bytes in %.3f ms", len(load.vllm_blocks), load.req_id, fetched,
                    len(load.vllm_blocks) * block_bytes, 1e3 * seconds)

    def _wait_for_gate(self, req_id: str) -> None:
        logger.info("KvcmConnector: %s waits for the test gate %s", req_id,
                    self._opts.test_load_gate)
        deadline = time.monotonic() + 60
        while not os.path.exists(self._opts.test_load_gate) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _fetch(self, req_id: str, page_hashes: List[bytes], run: FetchRun,
               blocks: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """Pulls a run of pages into the local agent's main pool; the local blocks of every
        page up to the run's end."""
        if len(blocks) != run.first_page:
            raise RuntimeError(f"fetch of pages from {run.first_page} after {len(blocks)} "
                               "local pages")
        end = run.first_page + len(run.source_blocks)
        response = self._session().fetch(
            self._client, self._ns, page_hashes[:end], source_agent_id=run.source_agent_id,
            source_block_ids=run.source_blocks, source_tier=run.source_tier,
            local_block_ids=[b for b, _ in blocks])
        tier = blocks[0][1] if blocks else int(kvcm.Tier.UNSPECIFIED)
        logger.info("KvcmConnector: fetched %d pages of %s from agent %s (%d bytes)",
                    response.fetched_pages, req_id, run.source_agent_id, response.bytes)
        return blocks + [(b, tier) for b in response.block_ids[run.first_page:end]]

    def wait_for_save(self, meta: KvcmConnectorMetadata) -> None:
        """Stores the step's whole new pages. kv_both (background_stores): off the step's
        critical path, on the copier thread, while vLLM samples, returns the step's outputs
        and schedules the next; start_load_kv joins it before the next forward, the first
        thing that may write a block these stores read (a finished request's blocks are
        freed, and may be handed to another request, only by that next schedule). On CUDA
        the copier first waits for an event recorded after this step's kernels.
        kv_producer stores in the step: its answer must mean the KV is in kvcm."""
        if not meta.stores or not self.stores_here:  # MLA: rank 0 stores for every rank
            return
        if not (self._loads() and self._opts.background_stores):
            self._save(meta.stores, None)
            return
        ready = None
        if self._blocks is not None and self._blocks.device.type == "cuda":
            ready = torch.cuda.current_stream(self._blocks.device).record_event()
        if self._copier is None:
            self._copier = _Background("kvcm-store", "store")
        self._copier.submit(lambda: self._save(meta.stores, ready))

    def _save(self, stores: List[StoreSpec], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        try:
            epoch = self._epoch()
        except Exception as e:  # noqa: BLE001 - a store that fails only costs a later hit
            logger.warning("KvcmConnector: agent unreachable, %d stores skipped: %s",
                           len(stores), e)
            return
        for store in stores:
            try:
                self._store(store, epoch)
            except Exception as e:  # noqa: BLE001
                logger.warning("KvcmConnector: store of %s failed: %s", store.req_id, e)

    def _store(self, store: StoreSpec, epoch: int) -> None:
        """Copies the pages the agent lacks into new blocks now; inserts them at the manager
        now (kv_producer) or in the background (kv_both)."""
        known = self._agent_blocks.get(store.req_id) or []
        if len(store.known_blocks[self._shard]) > len(known):
            known = list(store.known_blocks[self._shard])
        pages = len(store.vllm_blocks)
        if len(known) >= pages:
            return
        new_vllm = store.vllm_blocks[len(known):]
        start = time.perf_counter()
        session = self._session()
        if self._region is not None:  # the agent copies from vLLM's registered memory
            staged = session.stage(self._ns, new_vllm, epoch=epoch,
                                   writer=local_writer(self._region))
        else:
            staged = session.stage(self._ns, BlockBytes(self._blocks, new_vllm), epoch=epoch)
        logger.info("KvcmConnector: copied %d pages of %s to the agent: %d bytes in %.3f ms",
                    len(staged), store.req_id, len(staged) * self._blocks.block_bytes,
                    1e3 * (time.perf_counter() - start))
        known = list(known[:pages - len(new_vllm)])
        self._agent_blocks[store.req_id] = known + staged.block_ids

        # kv_producer inserts in the step (its answer means the KV is in kvcm): bounded by
        # request_deadline_ms. kv_both inserts off the engine's path, where a loaded manager
        # may take longer without holding anything up (at 500 ms, inserts failed under CI's
        # load and their pages were never cached).
        background = self._loads()
        deadline_ms = (max(self._opts.request_deadline_ms, _BACKGROUND_INSERT_DEADLINE_MS)
                       if background else self._opts.request_deadline_ms)

        def insert() -> None:
            result = session.commit(self._client, staged, self._agent_id, store.tokens,
                                    known_blocks=known, deadline_ms=deadline_ms)
            logger.info("KvcmConnector: stored %d new pages of %s (%d already present)",
                        result.stored_pages, store.req_id,
                        len(known) + result.duplicate_pages)

        if not background:
            insert()
        else:
            if self._inserter is None:
                self._inserter = _Background("kvcm-insert", "insert")
            self._inserter.submit(insert)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        if not finished_req_ids:
            return None, None
        finished = set(finished_req_ids)  # vLLM's set, reused after this returns

        def forget() -> None:
            for req_id in finished:
                self._agent_blocks.pop(req_id, None)

        if self._copier is not None:  # after the request's last store, which sets them
            self._copier.submit(forget)
        else:
            forget()
        return None, None

    def shutdown(self) -> None:
        for background in (self._copier, self._inserter):
            if background is not None:
                background.close()
        if self._region is not None:
            self._region.close()
        if self._agent is not None:
            self._agent.close()
