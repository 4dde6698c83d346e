"""Typed values of the kvcm API: enums, model specs, and the results of every call.

Enum values equal the kvcm.v1 proto values. Results are frozen dataclasses; sizes are in
the unit their name says (bytes, pages, tokens, ms).
"""

from __future__ import annotations

import datetime as _dt
import enum
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

# What `import kvcm` exports of this module (kvcm/__init__.py takes the list from here).
__all__ = [
    "AgentStats",
    "AttentionKind",
    "CATALOG",
    "CacheEvent",
    "ClientCounters",
    "Counters",
    "DeleteNamespaceResult",
    "EngineStats",
    "EventKind",
    "EventReason",
    "EvictResult",
    "ForgetAgentResult",
    "InsertResult",
    "KvDtype",
    "Limits",
    "MatchResult",
    "ModelSpec",
    "Namespace",
    "NamespaceStats",
    "PENDING_BLOCK_ID",
    "PageReplica",
    "PolicyCandidate",
    "PolicySelection",
    "PoolRef",
    "PoolStats",
    "RankedAgent",
    "RegisterModelResult",
    "Replica",
    "RouteCandidate",
    "RoutePolicy",
    "RouteResult",
    "Segment",
    "Stats",
    "TenantStats",
    "Tier",
]

DEFAULT_PAGE_SIZE_TOKENS = 64


class Tier(enum.IntEnum):
    """Memory tier of a pool."""

    UNSPECIFIED = 0
    GPU = 1
    HOST = 2
    DISK = 3


class AttentionKind(enum.IntEnum):
    UNSPECIFIED = 0
    MHA = 1
    MQA = 2
    GQA = 3
    MLA = 4


class KvDtype(enum.IntEnum):
    UNSPECIFIED = 0
    BF16 = 1
    FP16 = 2
    FP8 = 3
    INT8 = 4


class RoutePolicy(enum.IntEnum):
    """How Route orders the candidates (kvcm.v1.RoutePolicy)."""

    PREFILL_SAVED = 1  # most prefill saved, minus the queue's wait
    ROUND_ROBIN = 2  # the manager's Route counter
    FIRST_PAGE_HASH = 3  # the prompt's first page hash: cache-blind sticky routing
    LEAST_LOADED = 4  # lowest load


class EventKind(enum.IntEnum):
    UNSPECIFIED = 0
    STORED = 1
    REMOVED = 2
    CLEARED = 3


class EventReason(enum.IntEnum):
    UNSPECIFIED = 0
    EVICTED = 1
    EXPIRED = 2


@dataclass(frozen=True)
class Namespace:
    """Unit of isolation: pages never match across namespaces."""

    tenant: str
    model: str

    def __str__(self) -> str:
        return f"{self.tenant}/{self.model}"


@dataclass(frozen=True)
class PoolRef:
    """One byte-budgeted pool: the blocks of one agent in one tier."""

    agent_id: str
    tier: Tier = Tier.GPU

    def __str__(self) -> str:
        return f"{self.agent_id}:{self.tier.name.lower()}"


NamespaceLike = Union[Namespace, Tuple[str, str]]
PoolLike = Union[PoolRef, str, Tuple[str, Tier]]


def as_namespace(ns: NamespaceLike) -> Namespace:
    """A Namespace from a Namespace or a (tenant, model) pair."""
    if isinstance(ns, Namespace):
        return ns
    if isinstance(ns, tuple) and len(ns) == 2:
        return Namespace(str(ns[0]), str(ns[1]))
    raise TypeError(f"namespace: expected Namespace or (tenant, model), got {ns!r}")


def as_pool(pool: PoolLike) -> PoolRef:
    """A PoolRef from a PoolRef, an agent id (GPU tier) or an (agent_id, tier) pair."""
    if isinstance(pool, PoolRef):
        return pool
    if isinstance(pool, str):
        return PoolRef(pool)
    if isinstance(pool, tuple) and len(pool) == 2:
        return PoolRef(str(pool[0]), Tier(pool[1]))
    raise TypeError(f"pool: expected PoolRef, agent id or (agent_id, tier), got {pool!r}")


@dataclass(frozen=True)
class ModelSpec:
    """What one token of KV cache costs (kvcm.v1.ModelSpec). Element counts unless *_bytes."""

    attention: AttentionKind
    num_layers: int
    num_heads: int
    num_kv_heads: int = 0  # MHA: == num_heads; MQA: 1; GQA: divides num_heads; MLA: unused
    head_dim: int = 0  # MHA/MQA/GQA only
    kv_lora_rank: int = 0  # MLA only
    rope_dim: int = 0  # MLA only
    dtype: KvDtype = KvDtype.BF16
    page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS
    qk_nope_head_dim: int = 0  # MLA only, for the MHA-shaped comparison
    v_head_dim: int = 0
    # Opaque descriptor of one page's byte layout as the engine writes it, e.g.
    # "vllm-cpu/mla:[block,576]:bf16" (at most 256 bytes of printable ASCII); "" states none.
    # A namespace refuses a layout other than its own (FailedPrecondition); "" is compatible
    # with any, and a namespace without one takes the first stated.
    kv_layout: str = ""

    def with_(self, **changes: object) -> "ModelSpec":
        """A copy with some fields changed, e.g. spec.with_(dtype=KvDtype.FP8)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def bytes_per_token_per_layer(self) -> int:
        """KV bytes of one token in one layer, as the manager counts them (model_spec.h)."""
        elem = 2 if self.dtype in (KvDtype.BF16, KvDtype.FP16) else 1
        if self.attention == AttentionKind.MLA:
            if self.dtype == KvDtype.FP8:
                return self.kv_lora_rank + (self.kv_lora_rank // 128) * 4 + self.rope_dim * 2
            if self.dtype == KvDtype.INT8:
                return self.kv_lora_rank + 4 + self.rope_dim * 2
            return (self.kv_lora_rank + self.rope_dim) * elem
        heads = {AttentionKind.MHA: self.num_heads, AttentionKind.MQA: 1}.get(
            self.attention, self.num_kv_heads
        )
        per_layer = 2 * heads * self.head_dim * elem
        if self.dtype == KvDtype.INT8:
            per_layer += 2 * heads * 4
        return per_layer

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer() * self.num_layers

    def bytes_per_page(self) -> int:
        return self.bytes_per_token() * self.page_size_tokens

    # The model catalogue of common/model_catalog.cc (dimensions from the Hugging Face
    # configs); dtype and page size are the caller's.
    @classmethod
    def from_catalog(
        cls,
        name: str,
        dtype: KvDtype = KvDtype.BF16,
        page_size_tokens: int = DEFAULT_PAGE_SIZE_TOKENS,
    ) -> "ModelSpec":
        """The catalogue model `name` (case-insensitive, e.g. "deepseek-v3")."""
        spec = CATALOG.get(name.lower())
        if spec is None:
            raise KeyError(f"no model {name!r} in the catalogue; known: {', '.join(CATALOG)}")
        return replace(spec, dtype=KvDtype(dtype), page_size_tokens=page_size_tokens)

    # Shortcuts, each the catalogue name with "-" as "_" and without the dash between family
    # and version (llama3_8b is "llama-3-8b"). The catalogue name is the one vocabulary:
    # from_catalog, kvcmctl --model, kvcm-agent --model and the C++ catalogue take it.

    @classmethod
    def deepseek_v3(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("deepseek-v3", dtype, page_size_tokens)

    @classmethod
    def deepseek_r1(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("deepseek-r1", dtype, page_size_tokens)

    @classmethod
    def deepseek_v2(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("deepseek-v2", dtype, page_size_tokens)

    @classmethod
    def deepseek_v2_lite(
        cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64
    ) -> "ModelSpec":
        return cls.from_catalog("deepseek-v2-lite", dtype, page_size_tokens)

    @classmethod
    def llama3_8b(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("llama-3-8b", dtype, page_size_tokens)

    @classmethod
    def llama3_70b(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("llama-3-70b", dtype, page_size_tokens)

    @classmethod
    def mistral_7b(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("mistral-7b", dtype, page_size_tokens)

    @classmethod
    def llama2_7b(cls, dtype: KvDtype = KvDtype.BF16, page_size_tokens: int = 64) -> "ModelSpec":
        return cls.from_catalog("llama-2-7b", dtype, page_size_tokens)


def _mla(layers: int, heads: int) -> ModelSpec:
    return ModelSpec(
        AttentionKind.MLA,
        num_layers=layers,
        num_heads=heads,
        kv_lora_rank=512,
        rope_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )


CATALOG: Dict[str, ModelSpec] = {
    "deepseek-v3": _mla(61, 128),
    "deepseek-r1": _mla(61, 128),
    "deepseek-v2": _mla(60, 128),
    "deepseek-v2-lite": _mla(27, 16),
    "llama-3-8b": ModelSpec(AttentionKind.GQA, 32, 32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": ModelSpec(AttentionKind.GQA, 80, 64, num_kv_heads=8, head_dim=128),
    "mistral-7b": ModelSpec(AttentionKind.GQA, 32, 32, num_kv_heads=8, head_dim=128),
    "llama-2-7b": ModelSpec(AttentionKind.MHA, 32, 32, num_kv_heads=32, head_dim=128),
}


# ----------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class RegisterModelResult:
    spec: ModelSpec  # as stored by the manager (page size defaulted, its kv_layout)
    bytes_per_token: int
    bytes_per_page: int
    key_fingerprint: int  # of the namespace's hash key (the key stays inside the client)
    created: bool  # False: the namespace already existed with this (a compatible) spec
    max_page_age_s: int  # retention in force; 0: none


@dataclass(frozen=True)
class Replica:
    """A run of pages in one pool: one block id per page, in prompt order."""

    pool: PoolRef
    block_ids: List[int]


@dataclass(frozen=True)
class Segment:
    """Consecutive matched pages held by the same pools (requester's first)."""

    first_page: int
    num_pages: int
    replicas: List[Replica]


@dataclass(frozen=True)
class PageReplica:
    """Where one copy of one page lives. block_id 0xFFFFFFFF: a demotion not yet acked."""

    pool: PoolRef
    block_id: int


PENDING_BLOCK_ID = 0xFFFFFFFF


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a prompt. pages[i] lists every replica of page i."""

    matched_pages: int  # leading whole pages cached somewhere
    matched_tokens: int  # matched_pages * page size
    prompt_pages: int  # whole pages in the prompt
    local_pages: int  # leading pages on the requester's agent
    segments: List[Segment]
    pin_id: int  # 0 when no pin was taken
    lease_expiry_unix_ms: int  # of the pin; 0 without one
    pages: List[List[PageReplica]] = field(default_factory=list)

    @property
    def lease_expiry(self) -> Optional[_dt.datetime]:
        """The pin's lease expiry (UTC), or None without a pin."""
        if self.pin_id == 0 or self.lease_expiry_unix_ms <= 0:
            return None
        return _dt.datetime.fromtimestamp(self.lease_expiry_unix_ms / 1000, _dt.timezone.utc)


@dataclass(frozen=True)
class RouteCandidate:
    agent_id: str
    load: int = 0  # any unit, the same for every candidate
    queued_prefill_tokens: int = 0  # waiting for or in prefill on the agent


@dataclass(frozen=True)
class RankedAgent:
    """What serving the prompt on one agent is expected to save (kvcm.v1.RankedAgent)."""

    agent_id: str
    cached_pages: int  # leading pages it holds
    fetch_pages: int  # pages after those worth fetching from other agents
    recompute_pages: int  # pages left to prefill
    transfer_ms: float
    saved_prefill_ms: float
    link_gbps: float
    load: int
    queue_ms: float


@dataclass(frozen=True)
class RouteResult:
    ranked: List[RankedAgent]  # best first
    match: MatchResult  # the prompt matched for ranked[0] (pinned when asked)


@dataclass(frozen=True)
class InsertResult:
    already_present_pages: int  # leading pages the pool already held
    existing_block_ids: List[int]  # the index's blocks of those pages
    new_pages: int
    replicated_pages: int  # cached elsewhere, now also in this pool
    evicted_bytes: int


@dataclass(frozen=True)
class EvictResult:
    evicted_bytes: int
    evicted_pages: int
    demoted_pages: int  # moved to the agent's HOST pool instead of leaving


@dataclass(frozen=True)
class DeleteNamespaceResult:
    removed_pages: int  # page-locations removed (their blocks are freed on agents)
    dropped_pins: int


@dataclass(frozen=True)
class ForgetAgentResult:
    epoch: int  # the agent's registered epoch
    was_alive: bool  # only with force
    dropped_pages: int


@dataclass(frozen=True)
class PoolStats:
    pool: PoolRef
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    pages: int
    reserved_bytes: int
    engine: bool = False  # an engine's pool (PublishEngineEvents): capacity 0, never evicted


@dataclass(frozen=True)
class EngineStats:
    """An engine whose prefix cache the manager mirrors (one live session)."""

    engine_id: str
    namespace: Namespace
    session: int
    sequence: int  # last applied
    last_publish_age_ms: int
    ttl_ms: int
    pages: int  # page-locations in its pools


@dataclass(frozen=True)
class NamespaceStats:
    namespace: Namespace
    spec: ModelSpec
    bytes_per_token: int
    bytes_per_page: int
    pages: int  # distinct pages
    page_locations: int  # pages x replicas
    radix_nodes: int
    max_page_age_s: int
    expired_pages: int


@dataclass(frozen=True)
class Counters:
    match_requests: int
    requested_pages: int
    matched_pages: int
    inserted_pages: int
    evicted_pages: int
    evicted_bytes: int
    pins_taken: int
    pins_released: int
    lease_expiries: int
    requested_tokens: int
    matched_tokens: int
    eviction_regret_pages: int
    demoted_pages: int
    dropped_pages: int
    expired_pages: int


@dataclass(frozen=True)
class Limits:
    max_tokens_per_request: int
    max_pages_per_request: int
    max_lease_ttl_ms: int
    default_lease_ttl_ms: int


@dataclass(frozen=True)
class AgentStats:
    agent_id: str
    device: str
    epoch: int
    alive: bool
    last_heartbeat_age_ms: int
    tier: Tier
    used_bytes: int
    free_blocks: int
    heartbeats: int
    block_agent_address: str
    data_address: str
    transport: str
    pull_gbps: float


@dataclass(frozen=True)
class TenantStats:
    tenant: str
    namespaces: int
    stored_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    pins: int
    max_bytes: int
    max_pinned_bytes: int


@dataclass(frozen=True)
class PolicyCandidate:
    name: str  # a row of the manager's policy table ("lru", "cost", ...)
    shadow_hit_rate: float  # of its miniature caches, 0..1, over a decaying window


@dataclass(frozen=True)
class PolicySelection:
    """Eviction policy "select"'s choice. The hit rates are those of miniature caches fed a
    sample of the pages (one per candidate and GPU pool), not the real pools'."""

    active: str  # the candidate the index evicts in the order of
    candidates: List[PolicyCandidate]  # the policy table's order
    switches: int  # moves of the choice since the manager started
    sampled_lookup_pages: int  # GPU pools' looked-up pages that fell in the sample
    sampled_store_pages: int  # GPU pools' stored pages that fell in the sample
    shadow_pages: int  # page-locations all miniature caches hold
    pools: int  # GPU pools simulated
    min_sample_rate: float  # 1: every page; 0 before the first prompt

    def candidate(self, name: str) -> Optional[PolicyCandidate]:
        """One candidate by name, or None."""
        return next((c for c in self.candidates if c.name == name), None)


@dataclass(frozen=True)
class Stats:
    pools: List[PoolStats]
    namespaces: List[NamespaceStats]
    counters: Counters
    active_pins: int
    policy: str
    limits: Limits
    agents: List[AgentStats]
    tenants: List[TenantStats]
    engines: List[EngineStats] = field(default_factory=list)
    # Set only when the manager's policy is "select".
    selection: Optional[PolicySelection] = None

    def pool(self, pool: PoolLike) -> Optional[PoolStats]:
        """The stats of one pool, or None."""
        ref = as_pool(pool)
        return next((p for p in self.pools if p.pool == ref), None)

    def namespace(self, ns: NamespaceLike) -> Optional[NamespaceStats]:
        """The stats of one namespace, or None."""
        ref = as_namespace(ns)
        return next((n for n in self.namespaces if n.namespace == ref), None)


@dataclass(frozen=True)
class CacheEvent:
    """One index change from WatchEvents. sequence grows by one per event of this stream."""

    kind: EventKind
    reason: EventReason
    namespace: Namespace
    pool: PoolRef
    page_hashes: List[bytes]
    sequence: int


@dataclass(frozen=True)
class ClientCounters:
    """What a client has done; monotonic."""

    calls: int  # calls started
    attempts: int  # RPC attempts sent (calls + retries)
    retries: int  # attempts after an UNAVAILABLE answer


TokensLike = Union[Sequence[int], bytes, bytearray, memoryview]
