"""The scheduler half of kvcm's vLLM connector (in vLLM's EngineCore process): for each new
request, one Route per page set pins the prompt's cached pages for the engine's agent and
tells vLLM how many tokens it can load beyond its own prefix cache; each step's metadata
names the worker half's loads and stores; request_finished releases the pins."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import kvcm
from kvcm.types import PENDING_BLOCK_ID
from kvcm.vllm.config import HOST_TIER, ConnectorOptions, Shard, logger
from kvcm.vllm.metadata import FetchRun, KvcmConnectorMetadata, LoadSpec, ShardLoad, StoreSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _ShardMatch:
    """What the scheduler's Route found of a request's pages in one shard's namespace."""

    pin_id: int = 0
    page_hashes: List[bytes] = field(default_factory=list)
    local_blocks: List[Tuple[int, int]] = field(default_factory=list)
    fetch: List[FetchRun] = field(default_factory=list)

    def pages(self) -> int:
        return len(self.local_blocks) + sum(len(r.source_blocks) for r in self.fetch)

    def truncate(self, pages: int) -> None:
        """Keeps pages [0, pages) only: every shard loads the same pages."""
        self.local_blocks = self.local_blocks[:pages]
        left, runs = pages - len(self.local_blocks), []
        for run in self.fetch:
            if left <= 0:
                break
            runs.append(FetchRun(run.source_agent_id, run.source_tier, run.first_page,
                                 run.source_blocks[:left]))
            left -= len(runs[-1].source_blocks)
        self.fetch = runs


@dataclass
class _Request:
    """Scheduler state of one request, from its match to request_finished."""

    tokens: List[int]
    shards: List[_ShardMatch] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_external_tokens: int = 0
    block_ids: List[int] = field(default_factory=list)
    stored_pages: int = 0  # whole pages handed to the worker for storing


def _fetch_runs(match: kvcm.MatchResult, agent_id: str, first: int,
                count: int) -> List[FetchRun]:
    """Pages [first, first + count) from other agents' pools, as runs of consecutive pages
    of one source pool; stops at a page no other agent holds with a known block."""
    runs: List[FetchRun] = []
    for page in range(first, first + count):
        sources = [r for r in match.pages[page]
                   if r.pool.agent_id != agent_id and r.block_id != PENDING_BLOCK_ID]
        if not sources:
            break
        last = runs[-1] if runs else None
        same = [r for r in sources if last is not None and r.pool.agent_id == last.source_agent_id
                and int(r.pool.tier) == last.source_tier]
        if same:
            last.source_blocks.append(same[0].block_id)
            continue
        r = sources[0]
        runs.append(FetchRun(r.pool.agent_id, int(r.pool.tier), page, [r.block_id]))
    return runs


class ConnectorScheduler:
    """One per engine; vLLM calls it from its scheduler loop (one thread). Every manager
    call here is bounded by request_deadline_ms."""

    def __init__(self, opts: ConnectorOptions, client: kvcm.Client, shards: List[Shard],
                 block_size: int, loads: bool, stores: bool):
        self._opts, self._client, self._shards = opts, client, shards
        self._block_size = block_size
        self._loads_kv, self._stores_kv = loads, stores
        self._requests: Dict[str, _Request] = {}
        # Tensor parallelism (one page set per rank): the page sets' manager calls run at
        # once, so a request waits for the slowest one, not for their sum.
        self._pool = (ThreadPoolExecutor(len(shards), thread_name_prefix="kvcm-shard")
                      if len(shards) > 1 else None)

    def _each_shard(self, call: Callable[[int, Shard], Any]) -> List[Any]:
        """call(i, shard) for every page set, in shard order: its result, or the exception
        it raised."""
        def outcome(item: Tuple[int, Shard]) -> Any:
            try:
                return call(*item)
            except Exception as e:  # noqa: BLE001 - the caller decides
                return e

        items = list(enumerate(self._shards))
        return list(self._pool.map(outcome, items)) if self._pool else [outcome(x) for x in items]

    def _loads(self) -> bool:
        return self._loads_kv  # kv_consumer, kv_both

    def _stores(self) -> bool:
        return self._stores_kv  # kv_producer, kv_both

    @staticmethod
    def _cacheable(request: "Request") -> bool:
        return (not getattr(request, "cache_salt", None)
                and getattr(request, "lora_request", None) is None
                and not getattr(request, "mm_features", None))

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        self._release(request.request_id)
        if not self._cacheable(request):
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        state = _Request(tokens, num_computed_tokens=num_computed_tokens)
        self._requests[request.request_id] = state
        # At least one prompt token is always computed (vLLM needs its logits).
        loadable = (len(tokens) - 1) // self._block_size
        whole = len(tokens) // self._block_size
        # kv_producer matches too, though it never loads: the pages its agent holds
        # already are not stored again.
        if loadable == 0:
            return 0, False
        if self._loads() and loadable * self._block_size <= num_computed_tokens:
            # vLLM's own cache holds every loadable page: nothing to load. Those pages were
            # stored when they were computed; storing them again without the agent's blocks
            # would allocate (in a full pool: evict other prompts' pages) only to free
            # duplicates. Only a last page computed now (a prompt ending on a page
            # boundary) is stored, after the match below names the blocks before it.
            if whole == loadable or not self._stores():
                state.stored_pages = whole
                return 0, False
        try:
            # Every whole page is matched, the last one too when the prompt ends on a page
            # boundary: vLLM recomputes it, but the agent's block of it is named to the
            # store, which then does not copy it again.
            hit = self._match(state, tokens[: whole * self._block_size], loadable)
        except Exception as e:  # noqa: BLE001 - any failure: recompute
            logger.warning("KvcmConnector: match failed, recomputing: %s", e)
            hit = 0
        if not self._loads():
            return 0, False
        return max(0, hit - num_computed_tokens), False

    def _match(self, state: _Request, tokens: List[int], loadable: int) -> int:
        """Pins the prompt's cached pages in every shard for its agent; the tokens every
        shard can load (the fewest, at most `loadable` pages)."""
        results = self._each_shard(lambda _, shard: self._match_shard(shard, tokens, loadable))
        # A failed page set keeps its place (no pin), so the others' pins are released.
        state.shards = [r if isinstance(r, _ShardMatch) else _ShardMatch() for r in results]
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        pages = min(m.pages() for m in state.shards)
        for m in state.shards:
            m.truncate(pages)
        return min(pages, loadable) * self._block_size

    def _match_shard(self, shard: Shard, tokens: List[int], loadable: int) -> _ShardMatch:
        hashes = self._client.hash_prompt(shard.namespace, tokens)
        route = self._client.route(
            shard.namespace, page_hashes=hashes, candidates=[shard.agent_id], pin=True,
            lease_ttl_ms=self._opts.lease_ttl_ms,
            prefill_tokens_per_s=self._opts.prefill_tokens_per_s,
            deadline_ms=self._opts.request_deadline_ms)
        match = route.match
        m = _ShardMatch(pin_id=match.pin_id, page_hashes=hashes)
        ranked = next((r for r in route.ranked if r.agent_id == shard.agent_id), None)
        for replicas in match.pages:
            mine = [r for r in replicas
                    if r.pool.agent_id == shard.agent_id and r.block_id != PENDING_BLOCK_ID]
            if not mine:
                break
            main = [r for r in mine if int(r.pool.tier) != HOST_TIER]
            best = (main or mine)[0]
            m.local_blocks.append((best.block_id, int(best.pool.tier)))
        # Fetch into the main pool only after leading pages that are all in it (Fetch names
        # the destination's blocks of the pages before the pulled ones).
        # Pages past `loadable` are never loaded: none is fetched.
        fetch = min(ranked.fetch_pages if ranked is not None else 0,
                    loadable - len(m.local_blocks))
        if (self._opts.fetch and fetch > 0
                and all(tier != HOST_TIER for _, tier in m.local_blocks)):
            m.fetch = _fetch_runs(match, shard.agent_id, len(m.local_blocks), fetch)
        return m

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None:
            state.num_external_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvcmConnectorMetadata:
        meta = KvcmConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is None:
                continue
            state.block_ids = list(new_req.block_ids[0])
            state.num_computed_tokens = new_req.num_computed_tokens
            self._maybe_load(meta, new_req.req_id, state)
            self._maybe_store(meta, new_req.req_id, state,
                              scheduler_output.num_scheduled_tokens.get(new_req.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: new blocks, matched again when it was rescheduled
                # (get_num_new_matched_tokens); what was stored stays stored.
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            state.num_computed_tokens = cached.num_computed_tokens[i]
            self._maybe_load(meta, req_id, state)
            self._maybe_store(meta, req_id, state,
                              scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _maybe_load(self, meta: KvcmConnectorMetadata, req_id: str, state: _Request) -> None:
        """The load of the external tokens vLLM accepted (update_state_after_alloc), once:
        they end at num_computed_tokens."""
        if state.num_external_tokens <= 0:
            return
        bs = self._block_size
        first = (state.num_computed_tokens - state.num_external_tokens) // bs
        end = state.num_computed_tokens // bs
        shards = [ShardLoad(m.page_hashes[:end], m.local_blocks, m.fetch) for m in state.shards]
        meta.loads.append(LoadSpec(req_id, first, shards, state.block_ids[first:end]))
        state.num_external_tokens = 0

    def _maybe_store(self, meta: KvcmConnectorMetadata, req_id: str, state: _Request,
                     scheduled: int) -> None:
        """Stores the prompt's whole pages this step completes (chunked prefill: a page is
        stored by the step that computes its last token)."""
        if not self._stores():
            return
        bs = self._block_size
        done = min(state.num_computed_tokens + scheduled, len(state.tokens))
        pages = min(done // bs, len(state.block_ids))
        if pages <= state.stored_pages:
            return
        known = [[b for b, tier in m.local_blocks if tier != HOST_TIER] for m in state.shards]
        if len(known) != len(self._shards):  # not matched, or the match failed midway
            known = [[] for _ in self._shards]
        if pages > min(len(k) for k in known):
            meta.stores.append(StoreSpec(req_id, state.tokens[: pages * bs],
                                         state.block_ids[:pages], known))
        state.stored_pages = pages

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._release(request.request_id)
        return False, None

    def _release(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        pins = [m.pin_id for m in state.shards]
        pins += [0] * (len(self._shards) - len(pins))
        if not any(pins):
            return

        # Bounded: this runs on vLLM's scheduler loop, and the lease ends the pin anyway
        # (before, the client's 10 s default could stall the loop behind a stopped manager).
        # Synchronous, so that the next request's eviction sees it released.
        def release(i: int, shard: Shard) -> None:
            if pins[i]:
                self._client.release(shard.namespace, pins[i],
                                     deadline_ms=self._opts.request_deadline_ms)

        for pin, result in zip(pins, self._each_shard(release)):
            if isinstance(result, Exception):  # the lease expires anyway
                logger.info("KvcmConnector: release of pin %d failed: %s", pin, result)
