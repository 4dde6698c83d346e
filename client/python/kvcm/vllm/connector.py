"""kvcm as a vLLM (0.32, V1) KV connector: vLLM stores the full blocks it computes into its
local kvcm-agent and loads a prefix that any agent of the cluster holds instead of
recomputing it.

    --kv-transfer-config '{"kv_connector": "KvcmConnector",
        "kv_connector_module_path": "kvcm.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_address": "HOST:PORT", "agent_id": "gpu0",
            "agent_address": "HOST:PORT", "tenant": "t", "model": "m"}}'

Scheduler side (get_num_new_matched_tokens): one Route call for the local agent ranks the
prompt's cached pages: those the local agent holds, then those other agents hold that the
manager's cost model says are cheaper to fetch than to recompute. Both are pinned (lease
`lease_ttl_ms`) until request_finished. vLLM is told those tokens beyond its own hit.
Worker side (start_load_kv): pages held elsewhere are first pulled into the local agent
(BlockAgent.Fetch: TCP or NCCL between agents; the agent indexes the new replica), then
every page is read into vLLM's paged KV with its page hash, so the agent refuses a block
that no longer holds the page (pin lost, block evicted and reused). After the forward
(wait_for_save) the whole pages computed this step are copied into newly allocated agent
blocks and inserted at the manager; kv_both inserts in the background (the copy is done
when wait_for_save returns, so vLLM may reuse its blocks), kv_producer before returning
(its answer means the KV is in kvcm: prefill/decode disaggregation).

Bytes: with `local_socket` (the agent's --local_socket, same host) the worker moves vLLM's
KV tensors into one memfd it registers with the agent (kvcm.agent_local), and the agent
copies blocks between its pool and vLLM's cache itself, one memcpy per layer segment, with
the checks of ReadBlocks / WriteBlocks; vLLM never maps the agent's pool. Without it, bytes
go over the agent's gRPC ReadBlocks / WriteBlocks.

Block bytes: one agent block holds one vLLM block of every layer, layer after layer, each as
vLLM's per-block slice of that layer's cache (CPU backend: [kv_heads, block_size,
2 * head_dim], K then V in the last dim); it must have the namespace's bytes_per_block.
Any failure loads nothing (0 external tokens) or reports the blocks through
get_block_ids_with_load_errors, so vLLM recomputes them: never wrong KV.

Requests with a cache_salt, LoRA or multimodal inputs are served without kvcm: their KV
depends on more than the token ids a page hash covers.

Runs inside vLLM's processes: imports kvcm (grpcio + protobuf of vLLM's environment) and
torch; no other dependency.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

import kvcm
from kvcm import _cli
from kvcm._options import channel_credentials
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc
from kvcm.types import PENDING_BLOCK_ID

if TYPE_CHECKING:
    from kvcm.agent_local import LocalRegion
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration shows it.
logger = init_logger("vllm.kvcm_connector")

_DTYPES = {torch.bfloat16: kvcm.KvDtype.BF16, torch.float16: kvcm.KvDtype.FP16}
_MAX_BLOCKS_PER_CALL = 64  # the agent's default max_blocks_per_call
_RPC_TIMEOUT_S = 10.0
_HOST = int(kvcm.Tier.HOST)
# Deprecated kv_connector_extra_config keys -> their names (issue 26's vocabulary).
EXTRA_CONFIG_ALIASES = {"ca_file": "tls_ca_file", "cert_file": "tls_cert_file",
                        "key_file": "tls_key_file", "manager": "manager_address",
                        "agent": "agent_address"}


@dataclass
class ConnectorOptions:
    """kv_connector_extra_config. Addresses are host:port; plaintext only in this slice."""

    manager_address: str
    agent_id: str
    agent_address: str
    tenant: str = "default"
    model: str = ""  # default: vLLM's served model name
    lease_ttl_ms: int = 60_000  # of a load's pin; request_finished releases it sooner
    # Bound on each manager call on a request's path (Route, a producer's Insert): past it
    # the call fails and the request computes its prefill (a miss) or stores nothing, rather
    # than waiting out a manager takeover under the client's default deadline.
    request_deadline_ms: int = 500
    # What recomputing a token costs on this engine (Route's cost model for fetches);
    # 0: the manager's route_prefill_tokens_per_s.
    prefill_tokens_per_s: float = 0.0
    # Fetch pages other agents hold when the cost model says so (False: local pages only).
    fetch: bool = True
    # TLS to the manager and the agent (tls_ca_file; tls_cert_file + tls_key_file: mutual
    # TLS) and the bearer token (token_file, else $KVCM_TOKEN); no tls_ca_file: plaintext.
    # The keys ca_file, cert_file, key_file are deprecated aliases (a warning is logged).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    # The agent's --local_socket: the engine registers its KV memory with the agent
    # (kvcm.agent_local), which copies blocks in and out with one memcpy. Empty: bytes go
    # over BlockAgent's ReadBlocks / WriteBlocks.
    local_socket: str = ""
    # For failure tests only: before reading a load's blocks (after fetching them), wait
    # until this file exists (at most 60 s), so a test can break things mid-load.
    test_load_gate: str = ""

    @classmethod
    def from_extra(cls, extra: Dict[str, Any], served_model: str) -> "ConnectorOptions":
        extra = _cli.rename_keys(extra, EXTRA_CONFIG_ALIASES, "KvcmConnector",
                                 "kv_connector_extra_config", warn=logger.warning)
        missing = [k for k in ("manager_address", "agent_id", "agent_address") if not extra.get(k)]
        if missing:
            raise ValueError(f"KvcmConnector: kv_connector_extra_config lacks {missing}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"KvcmConnector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(known)})")
        return cls(
            manager_address=str(extra["manager_address"]),
            agent_id=str(extra["agent_id"]),
            agent_address=str(extra["agent_address"]),
            tenant=str(extra.get("tenant", "default")),
            model=str(extra.get("model") or served_model),
            lease_ttl_ms=int(extra.get("lease_ttl_ms", 60_000)),
            request_deadline_ms=int(extra.get("request_deadline_ms", 500)),
            prefill_tokens_per_s=float(extra.get("prefill_tokens_per_s", 0.0)),
            fetch=bool(extra.get("fetch", True)),
            tls_ca_file=str(extra.get("tls_ca_file", "")),
            tls_cert_file=str(extra.get("tls_cert_file", "")),
            tls_key_file=str(extra.get("tls_key_file", "")),
            token_file=str(extra.get("token_file", "")),
            local_socket=str(extra.get("local_socket", "")),
            test_load_gate=str(extra.get("test_load_gate", "")),
        )


def unsupported_reason(vllm_config: "VllmConfig") -> Optional[str]:
    """Why this connector must not run with `vllm_config`, or None. Shapes it would get wrong
    without an error are refused before anything is registered (never wrong bytes):
    MLA models (their latent layout is not GQA's: the spec would be wrong), tensor or
    pipeline parallelism (every rank's KV shard would share one namespace, so a rank could
    load another's shard), and KV caches off the CPU (the connector copies through host
    memory in the CPU backend's block layout only). Issue 34 supports them."""
    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if getattr(mc, "use_mla", False):
        return ("KvcmConnector: MLA models (this one caches a latent of head size "
                f"{mc.get_head_size()}) are not supported yet: their pages would be described "
                "as GQA KV. Run without the connector")
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if tp > 1 or pp > 1:
        return (f"KvcmConnector: tensor_parallel_size {tp} / pipeline_parallel_size {pp} is "
                "not supported yet: every rank's KV shard would share one namespace and a rank "
                "could load another rank's shard. Run with one rank per engine (data "
                "parallelism with one agent per engine rank is fine)")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if device not in ("cpu", None):
        return (f"KvcmConnector: a KV cache on device '{device}' is not supported yet: the "
                "connector copies KV through host memory in vLLM's CPU block layout only")
    return None


def load_failure_warning(kv_transfer_config: Any) -> Optional[str]:
    """A warning when vLLM would fail requests whose kvcm load fails (its default
    kv_load_failure_policy "fail"): any agent fault (a restart, a lost pin, an evicted
    block) then fails user requests instead of recomputing their prefix. None for
    "recompute"."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy in ("recompute", None):
        return None
    return (f"KvcmConnector: kv_load_failure_policy is \"{policy}\": a failed kvcm load (an "
            "agent restarted, a pin lost, a block evicted) fails the request instead of "
            "recomputing its prefix. Set \"kv_load_failure_policy\": \"recompute\" in "
            "--kv-transfer-config (README)")


def unsupported_kv_cache(kv_caches: List[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """Why the connector must not move these KV tensors, or None: only tensors in host
    memory (a CUDA tensor's .numpy() would raise on every store, after three agent calls)."""
    for name, t in kv_caches:
        if t.device.type != "cpu":
            return (f"KvcmConnector: KV layer {name} is on {t.device}: the connector copies KV "
                    "through host memory in vLLM's CPU block layout only (not supported yet)")
    return None


def model_spec_of(vllm_config: "VllmConfig") -> kvcm.ModelSpec:
    """The namespace's model spec from vLLM's model and cache config (GQA/MHA only)."""
    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None or vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"KvcmConnector: KV dtype {mc.dtype} / "
                         f"{vllm_config.cache_config.cache_dtype} not supported (bf16, fp16)")
    heads = mc.get_num_attention_heads(parallel)
    kv_heads = mc.get_num_kv_heads(parallel)
    return kvcm.ModelSpec(
        attention=kvcm.AttentionKind.MHA if heads == kv_heads else kvcm.AttentionKind.GQA,
        num_layers=mc.get_num_layers(parallel),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=mc.get_head_size(),
        dtype=dtype,
        page_size_tokens=vllm_config.cache_config.block_size,
    )


@dataclass
class FetchRun:
    """Pages [first_page, first_page + len(source_blocks)) of a prompt, held by another
    agent's pool: pulled into the local agent before they are loaded."""

    source_agent_id: str
    source_tier: int
    first_page: int
    source_blocks: List[int]


@dataclass
class LoadSpec:
    """Load pages [first_page, end) of a request into vLLM blocks `vllm_blocks`. The local
    agent holds pages [0, len(local_blocks)) (block, tier each); `fetch` brings the rest."""

    req_id: str
    first_page: int
    page_hashes: List[bytes]  # pages [0, end)
    local_blocks: List[Tuple[int, int]]
    fetch: List[FetchRun]
    vllm_blocks: List[int]  # pages [first_page, end)


@dataclass
class StoreSpec:
    """A request's whole pages [0, num_pages) are computed: the worker stores those the
    local agent does not hold yet. `known_blocks`: the local agent's (main pool) blocks of
    leading pages, as the scheduler's match found them."""

    req_id: str
    tokens: List[int]
    vllm_blocks: List[int]
    known_blocks: List[int]


@dataclass
class KvcmConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    stores: List[StoreSpec] = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler state of one request, from its match to request_finished."""

    tokens: List[int]
    pin_id: int = 0
    page_hashes: List[bytes] = field(default_factory=list)
    local_blocks: List[Tuple[int, int]] = field(default_factory=list)
    fetch: List[FetchRun] = field(default_factory=list)
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


class _Inserter:
    """One background thread that runs the manager Inserts of kv_both stores in order."""

    def __init__(self) -> None:
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvcm-insert", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            try:
                work()
            except Exception as e:  # noqa: BLE001 - a failed insert only costs a later hit
                logger.warning("KvcmConnector: background insert failed: %s", e)

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


class KvcmConnector(KVConnectorBase_V1):
    """One instance per role (scheduler, worker); vLLM calls each from one thread."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        served = vllm_config.model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0]
        self._opts = ConnectorOptions.from_extra(extra, str(served or "model"))
        self._block_size = vllm_config.cache_config.block_size
        # Refused before any namespace is registered: a wrong spec would outlive this engine.
        if (reason := unsupported_reason(vllm_config)) is not None:
            raise ValueError(reason)
        self._spec = model_spec_of(vllm_config)
        if self._kv_transfer_config.is_kv_consumer and (
                warning := load_failure_warning(self._kv_transfer_config)) is not None:
            logger.warning("%s", warning)
        self._ns = kvcm.Namespace(self._opts.tenant, self._opts.model)
        o = self._opts
        self._client = kvcm.Client(o.manager_address, insecure=not o.tls_ca_file,
                                   ca_file=o.tls_ca_file or None,
                                   cert_file=o.tls_cert_file or None,
                                   key_file=o.tls_key_file or None,
                                   token_file=o.token_file or None)
        self._token = self._client.options.token  # token_file's, else $KVCM_TOKEN's
        self._metadata = (("authorization", f"Bearer {self._token}"),) if self._token else ()
        # Creates or confirms the namespace (and caches its hash key); a different spec
        # under the same name refuses to start (vLLM's KV would be read as another layout).
        try:
            self._client.register_model(self._ns, self._spec)
        except kvcm.KvcmError as e:
            self._client.close()
            raise ValueError(f"KvcmConnector: namespace {self._ns} refuses vLLM's layout "
                             f"{self._spec}: {e}") from e
        # Scheduler state.
        self._requests: Dict[str, _Request] = {}
        # Worker state.
        self._kv_caches: List[Tuple[str, torch.Tensor]] = []
        self._agent_block_bytes = 0  # one vLLM block of every layer (register_kv_caches)
        self._load_errors: Set[int] = set()
        self._agent: Optional[agent_pb2_grpc.BlockAgentStub] = None
        self._channel: Optional[grpc.Channel] = None
        # Local agent blocks (main pool) of each running request's leading pages: what a
        # later step's store names for the pages before its own.
        self._agent_blocks: Dict[str, List[int]] = {}
        self._inserter: Optional[_Inserter] = None
        self._region: Optional["LocalRegion"] = None
        logger.info("KvcmConnector (%s, %s): namespace %s, agent %s at %s, spec %s", role.name,
                    self._kv_transfer_config.kv_role, self._ns, self._opts.agent_id, self._opts.agent_address,
                    self._spec)

    # ---- scheduler side -----------------------------------------------------------------

    def _loads(self) -> bool:
        return bool(self._kv_transfer_config.is_kv_consumer)  # kv_consumer, kv_both

    def _stores(self) -> bool:
        return bool(self._kv_transfer_config.is_kv_producer)  # kv_producer, kv_both

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
            whole = len(tokens) // self._block_size
            if whole == loadable or not self._stores():
                state.stored_pages = whole
                return 0, False
        try:
            hit = self._match(state, tokens[: loadable * self._block_size])
        except Exception as e:  # noqa: BLE001 - any failure: recompute
            logger.warning("KvcmConnector: match failed, recomputing: %s", e)
            hit = 0
        if not self._loads():
            return 0, False
        return max(0, hit - num_computed_tokens), False

    def _match(self, state: _Request, tokens: List[int]) -> int:
        """Pins the prompt's cached pages for the local agent; the tokens it can load."""
        hashes = self._client.hash_prompt(self._ns, tokens)
        route = self._client.route(
            self._ns, page_hashes=hashes, candidates=[self._opts.agent_id], pin=True,
            lease_ttl_ms=self._opts.lease_ttl_ms,
            prefill_tokens_per_s=self._opts.prefill_tokens_per_s,
            deadline_ms=self._opts.request_deadline_ms)
        match = route.match
        state.pin_id = match.pin_id
        state.page_hashes = hashes
        ranked = next((r for r in route.ranked if r.agent_id == self._opts.agent_id), None)
        for replicas in match.pages:
            mine = [r for r in replicas
                    if r.pool.agent_id == self._opts.agent_id and r.block_id != PENDING_BLOCK_ID]
            if not mine:
                break
            main = [r for r in mine if int(r.pool.tier) != _HOST]
            best = (main or mine)[0]
            state.local_blocks.append((best.block_id, int(best.pool.tier)))
        local = len(state.local_blocks)
        # Fetch into the main pool only after leading pages that are all in it (Fetch names
        # the destination's blocks of the pages before the pulled ones).
        if (self._opts.fetch and ranked is not None and ranked.fetch_pages > 0
                and all(tier != _HOST for _, tier in state.local_blocks)):
            state.fetch = _fetch_runs(match, self._opts.agent_id, local, ranked.fetch_pages)
        pages = local + sum(len(r.source_blocks) for r in state.fetch)
        return pages * self._block_size

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None:
            state.num_external_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
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
        meta.loads.append(LoadSpec(req_id, first, state.page_hashes[:end], state.local_blocks,
                                   state.fetch, state.block_ids[first:end]))
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
        known = [b for b, tier in state.local_blocks if tier != _HOST]
        if pages > len(known):
            meta.stores.append(StoreSpec(req_id, state.tokens[: pages * bs],
                                         state.block_ids[:pages], known))
        state.stored_pages = pages

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._release(request.request_id)
        return False, None

    def _release(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is None or state.pin_id == 0:
            return
        try:
            # Bounded: this runs on vLLM's scheduler loop, and the lease ends the pin anyway
            # (before, the client's 10 s default could stall the loop behind a stopped
            # manager). Synchronous, so that the next request's eviction sees it released.
            self._client.release(self._ns, state.pin_id,
                                 deadline_ms=self._opts.request_deadline_ms)
        except Exception as e:  # noqa: BLE001 - the lease expires anyway
            logger.info("KvcmConnector: release of pin %d failed: %s", state.pin_id, e)

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        # Layer order = model order (vLLM's names end ".layers.<i>.self_attn.attn").
        def layer_index(name: str) -> Tuple[int, str]:
            digits = [p for p in name.split(".") if p.isdigit()]
            return (int(digits[0]) if digits else 0, name)

        self._kv_caches = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        if (reason := unsupported_kv_cache(self._kv_caches)) is not None:
            raise ValueError(reason)
        per_block = self._agent_block_bytes = sum(t[0].numel() * t.element_size()
                                                  for _, t in self._kv_caches)
        expected = (self._spec.bytes_per_token_per_layer() * self._spec.num_layers
                    * self._block_size)
        logger.info("KvcmConnector: %d KV layers, layer 0 shape %s stride %s dtype %s; "
                    "%d bytes per block (namespace spec: %d)", len(self._kv_caches),
                    tuple(self._kv_caches[0][1].shape), self._kv_caches[0][1].stride(),
                    self._kv_caches[0][1].dtype, per_block, expected)
        if per_block != expected:
            raise ValueError(f"KvcmConnector: vLLM's KV block is {per_block} bytes, namespace "
                             f"{self._ns}'s spec {self._spec} makes {expected}")
        if self._opts.local_socket:
            self._register_region()

    def _register_region(self) -> None:
        """Moves vLLM's KV tensors into one memfd region (each layer page-aligned) and
        registers it with the agent: from now on the agent copies blocks into and out of
        vLLM's cache itself. The tensors keep their identity (set_), so every reference
        vLLM holds sees the new memory."""
        from kvcm.agent_local import LocalRegion

        layers = [t for _, t in self._kv_caches]
        for name, t in self._kv_caches:
            if not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"KvcmConnector: local_socket needs contiguous CPU KV tensors; "
                                 f"{name} is {t.device} stride {t.stride()}")
        sizes = [t.numel() * t.element_size() for t in layers]
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        segment = layers[0][0].numel() * layers[0].element_size()
        region = LocalRegion(self._opts.local_socket, region_bytes=end,
                             segment_offsets=offsets, segment_bytes=segment,
                             segment_stride=segment, num_engine_blocks=layers[0].shape[0],
                             token=self._token)
        for t, offset in zip(layers, offsets):
            moved = torch.frombuffer(region.buffer, dtype=t.dtype, count=t.numel(),
                                     offset=offset).view(t.shape)
            moved.copy_(t)
            t.set_(moved)
        self._region = region
        logger.info("KvcmConnector: vLLM's KV cache (%d bytes) is registered with the agent "
                    "at %s", end, self._opts.local_socket)

    def _stub(self) -> agent_pb2_grpc.BlockAgentStub:
        if self._agent is None:
            options = [("grpc.max_receive_message_length", 64 << 20),
                       ("grpc.max_send_message_length", 64 << 20)]
            creds = channel_credentials(self._client.options)
            self._channel = (grpc.insecure_channel(self._opts.agent_address, options=options)
                             if creds is None else
                             grpc.secure_channel(self._opts.agent_address, creds, options=options))
            self._agent = agent_pb2_grpc.BlockAgentStub(self._channel)
        return self._agent

    def _epoch(self) -> int:
        """The agent's epoch (asked once a step that moves blocks: a restarted agent has a
        new one, and its old blocks are gone)."""
        return self._stub().Stats(agent_pb2.BlockAgentStatsRequest(), timeout=_RPC_TIMEOUT_S,
                                  metadata=self._metadata).epoch

    def _block_bytes(self, vllm_block: int) -> bytes:
        parts = [t[vllm_block].contiguous().view(torch.uint8).reshape(-1)
                 for _, t in self._kv_caches]
        return torch.cat(parts).numpy().tobytes()

    def _fill_block(self, vllm_block: int, data: memoryview) -> None:
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for _, t in self._kv_caches:
            dst = t[vllm_block]
            n = dst.numel() * dst.element_size()
            dst.copy_(src[offset:offset + n].view(t.dtype).view(dst.shape))
            offset += n

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
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
        blocks = list(load.local_blocks)
        fetched = 0
        for run in load.fetch:
            blocks = self._fetch(load, run, blocks)
            fetched += len(run.source_blocks)
        self._agent_blocks[load.req_id] = [b for b, tier in blocks if tier != _HOST]
        if self._opts.test_load_gate:
            self._wait_for_gate(load.req_id)
        end = load.first_page + len(load.vllm_blocks)
        if len(blocks) < end:
            raise RuntimeError(f"the agent holds {len(blocks)} of {end} pages")
        block_bytes = self._agent_block_bytes
        start = time.perf_counter()
        page = load.first_page
        while page < end:
            # One ReadBlocks per run of pages in one tier, at most _MAX_BLOCKS_PER_CALL.
            tier = blocks[page][1]
            stop = page
            while stop < end and stop - page < _MAX_BLOCKS_PER_CALL and blocks[stop][1] == tier:
                stop += 1
            # With the pages' hashes, the agent checks under its lock that each block still
            # holds its page (a lost pin's block may hold another page by now).
            agent_ids = [b for b, _ in blocks[page:stop]]
            vllm_ids = load.vllm_blocks[page - load.first_page:stop - load.first_page]
            if self._region is not None:
                self._region.load(agent_ids, vllm_ids, owner_epoch=epoch, tier=tier,
                                  namespace=self._ns,
                                  page_hashes=b"".join(load.page_hashes[page:stop]))
                page = stop
                continue
            request = agent_pb2.ReadBlocksRequest(
                block_ids=[b for b, _ in blocks[page:stop]], owner_epoch=epoch, tier=tier,
                page_hashes=b"".join(load.page_hashes[page:stop]))
            request.namespace.tenant, request.namespace.model = self._ns.tenant, self._ns.model
            data = b"".join(r.data for r in self._stub().ReadBlocks(
                request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata))
            if len(data) != block_bytes * (stop - page):
                raise RuntimeError(f"ReadBlocks returned {len(data)} bytes for "
                                   f"{stop - page} blocks of {block_bytes}")
            view = memoryview(data)
            for j in range(stop - page):
                vllm_block = load.vllm_blocks[page - load.first_page + j]
                self._fill_block(vllm_block, view[j * block_bytes:(j + 1) * block_bytes])
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

    def _fetch(self, load: LoadSpec, run: FetchRun,
               blocks: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """Pulls a run of pages into the local agent's main pool; the local blocks of every
        page up to the run's end."""
        if len(blocks) != run.first_page:
            raise RuntimeError(f"fetch of pages from {run.first_page} after {len(blocks)} "
                               "local pages")
        end = run.first_page + len(run.source_blocks)
        request = agent_pb2.FetchRequest(
            prompt=self._client.hashed_prompt(self._ns, load.page_hashes[:end]),
            local_block_ids=[b for b, _ in blocks], source_agent_id=run.source_agent_id,
            source_tier=run.source_tier, source_block_ids=run.source_blocks)
        request.namespace.tenant, request.namespace.model = self._ns.tenant, self._ns.model
        response = self._stub().Fetch(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        if len(response.block_ids) < end:
            raise RuntimeError(f"Fetch answered {len(response.block_ids)} blocks for "
                               f"{end} pages")
        tier = blocks[0][1] if blocks else int(kvcm.Tier.UNSPECIFIED)
        logger.info("KvcmConnector: fetched %d pages of %s from agent %s (%d bytes)",
                    response.fetched_pages, load.req_id, run.source_agent_id, response.bytes)
        return blocks + [(b, tier) for b in response.block_ids[run.first_page:end]]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save stores whole blocks of every layer after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        if not meta.stores:
            return
        try:
            epoch = self._epoch()
        except Exception as e:  # noqa: BLE001 - a store that fails only costs a later hit
            logger.warning("KvcmConnector: agent unreachable, %d stores skipped: %s",
                           len(meta.stores), e)
            return
        for store in meta.stores:
            try:
                self._store(store, epoch)
            except Exception as e:  # noqa: BLE001
                logger.warning("KvcmConnector: store of %s failed: %s", store.req_id, e)

    def _store(self, store: StoreSpec, epoch: int) -> None:
        """Copies the pages the agent lacks into new blocks now; inserts them at the manager
        now (kv_producer) or in the background (kv_both)."""
        known = self._agent_blocks.get(store.req_id) or []
        if len(store.known_blocks) > len(known):
            known = list(store.known_blocks)
        pages = len(store.vllm_blocks)
        if len(known) >= pages:
            return
        new_vllm = store.vllm_blocks[len(known):]
        start = time.perf_counter()
        stub = self._stub()
        request = agent_pb2.AllocateBlocksRequest(count=len(new_vllm), owner_epoch=epoch)
        request.namespace.tenant, request.namespace.model = self._ns.tenant, self._ns.model
        allocated = stub.Allocate(request, timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        new_agent = list(allocated.block_ids)
        generations = list(allocated.block_generations)
        try:
            for i in range(0, len(new_agent), _MAX_BLOCKS_PER_CALL):
                ids = new_agent[i:i + _MAX_BLOCKS_PER_CALL]
                gens = generations[i:i + _MAX_BLOCKS_PER_CALL]
                if self._region is not None:
                    self._region.store(ids, new_vllm[i:i + len(ids)], owner_epoch=epoch,
                                       generations=gens)
                    continue
                payload = [self._block_bytes(b) for b in new_vllm[i:i + len(ids)]]

                def messages(ids=ids, gens=gens, payload=payload):
                    yield agent_pb2.WriteBlocksRequest(header=agent_pb2.WriteBlocksHeader(
                        block_ids=ids, owner_epoch=epoch, block_generations=gens))
                    for chunk in payload:
                        yield agent_pb2.WriteBlocksRequest(data=chunk)

                stub.WriteBlocks(messages(), timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        except Exception:
            self._free(new_agent, generations, epoch)
            raise
        logger.info("KvcmConnector: copied %d pages of %s to the agent: %d bytes in %.3f ms",
                    len(new_agent), store.req_id, len(new_agent) * self._agent_block_bytes,
                    1e3 * (time.perf_counter() - start))
        all_blocks = list(known[:pages - len(new_vllm)]) + new_agent
        self._agent_blocks[store.req_id] = all_blocks

        def insert() -> None:
            self._insert(store, all_blocks, len(known), new_agent, generations, epoch)

        if not self._loads():  # kv_producer: its answer means the KV is in kvcm
            insert()
        else:
            if self._inserter is None:
                self._inserter = _Inserter()
            self._inserter.submit(insert)

    def _insert(self, store: StoreSpec, blocks: List[int], present: int, new_agent: List[int],
                generations: List[int], epoch: int) -> None:
        try:
            result = self._client.insert(self._ns, store.tokens, self._opts.agent_id, blocks,
                                         agent_epoch=epoch,
                                         deadline_ms=self._opts.request_deadline_ms)
        except Exception:
            self._free(new_agent, generations, epoch)
            raise
        # Pages another request stored meanwhile: our copies of them are duplicates.
        dup = [(b, g) for k, (b, g) in enumerate(zip(new_agent, generations))
               if present + k < result.already_present_pages
               and (present + k >= len(result.existing_block_ids)
                    or result.existing_block_ids[present + k] != b)]
        if dup:
            self._free([b for b, _ in dup], [g for _, g in dup], epoch)
        logger.info("KvcmConnector: stored %d new pages of %s (%d already present)",
                    len(new_agent) - len(dup), store.req_id, present + len(dup))

    def _free(self, block_ids: List[int], generations: List[int], epoch: int) -> None:
        try:
            self._stub().Free(agent_pb2.FreeBlocksRequest(
                block_ids=block_ids, owner_epoch=epoch, block_generations=generations),
                timeout=_RPC_TIMEOUT_S, metadata=self._metadata)
        except Exception as e:  # noqa: BLE001
            logger.info("KvcmConnector: free of %d blocks failed: %s", len(block_ids), e)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        for req_id in finished_req_ids:
            self._agent_blocks.pop(req_id, None)
        return None, None

    def shutdown(self) -> None:
        if self._inserter is not None:
            self._inserter.close()
        if self._region is not None:
            self._region.close()
        if self._channel is not None:
            self._channel.close()
        self._client.close()
