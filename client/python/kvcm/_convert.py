"""Conversions between kvcm.types and the generated kvcm.v1 messages. Internal."""

from __future__ import annotations

from typing import Any, List, TypeVar

from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import common_pb2 as common_pb
from kvcm.hashing import decode_page_hashes
from kvcm.types import (
    AgentStats,
    AttentionKind,
    CacheEvent,
    Counters,
    EventKind,
    EventReason,
    EngineStats,
    EvictResult,
    InsertResult,
    KvDtype,
    Limits,
    MatchResult,
    ModelSpec,
    Namespace,
    NamespaceStats,
    PageReplica,
    PolicyCandidate,
    PolicySelection,
    PoolRef,
    PoolStats,
    RankedAgent,
    Replica,
    RouteResult,
    Segment,
    Stats,
    TenantStats,
    Tier,
)

E = TypeVar("E")


def _enum(cls: Any, value: int) -> Any:
    """cls(value), or cls(0) (UNSPECIFIED) for a value this client does not know."""
    try:
        return cls(value)
    except ValueError:
        return cls(0)


def namespace_to_proto(ns: Namespace, out: common_pb.Namespace) -> None:
    out.tenant = ns.tenant
    out.model = ns.model


def pool_to_proto(pool: PoolRef, out: common_pb.PoolRef) -> None:
    out.agent_id = pool.agent_id
    out.tier = int(pool.tier)


def spec_to_proto(spec: ModelSpec, out: common_pb.ModelSpec) -> None:
    out.attention = int(spec.attention)
    out.num_layers = spec.num_layers
    out.num_heads = spec.num_heads
    out.num_kv_heads = spec.num_kv_heads
    out.head_dim = spec.head_dim
    out.kv_lora_rank = spec.kv_lora_rank
    out.rope_dim = spec.rope_dim
    out.dtype = int(spec.dtype)
    out.page_size_tokens = spec.page_size_tokens
    out.qk_nope_head_dim = spec.qk_nope_head_dim
    out.v_head_dim = spec.v_head_dim
    out.kv_layout = spec.kv_layout


def namespace_from_proto(m: common_pb.Namespace) -> Namespace:
    return Namespace(m.tenant, m.model)


def pool_from_proto(m: common_pb.PoolRef) -> PoolRef:
    return PoolRef(m.agent_id, _enum(Tier, m.tier))


def spec_from_proto(m: common_pb.ModelSpec) -> ModelSpec:
    return ModelSpec(
        attention=_enum(AttentionKind, m.attention),
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        kv_lora_rank=m.kv_lora_rank,
        rope_dim=m.rope_dim,
        dtype=_enum(KvDtype, m.dtype),
        page_size_tokens=m.page_size_tokens,
        qk_nope_head_dim=m.qk_nope_head_dim,
        v_head_dim=m.v_head_dim,
        kv_layout=m.kv_layout,
    )


def match_from_proto(m: pb.MatchResponse) -> MatchResult:
    segments = []
    pages: List[List[PageReplica]] = [[] for _ in range(m.matched_pages)]
    for s in m.segments:
        replicas = []
        for r in s.replicas:
            pool = pool_from_proto(r.pool)
            block_ids = list(r.block_ids)
            replicas.append(Replica(pool, block_ids))
            for i, block in enumerate(block_ids[: s.num_pages]):
                page = s.first_page + i
                if page < len(pages):
                    pages[page].append(PageReplica(pool, block))
        segments.append(Segment(s.first_page, s.num_pages, replicas))
    return MatchResult(
        matched_pages=m.matched_pages,
        matched_tokens=m.matched_tokens,
        prompt_pages=m.prompt_pages,
        local_pages=m.local_pages,
        segments=segments,
        pin_id=m.pin_id,
        lease_expiry_unix_ms=m.lease_expiry_unix_ms,
        pages=pages,
    )


def route_from_proto(m: pb.RouteResponse) -> RouteResult:
    ranked = [
        RankedAgent(
            agent_id=r.agent_id,
            cached_pages=r.cached_pages,
            fetch_pages=r.fetch_pages,
            recompute_pages=r.recompute_pages,
            transfer_ms=r.transfer_ms,
            saved_prefill_ms=r.saved_prefill_ms,
            link_gbps=r.link_gbps,
            load=r.load,
            queue_ms=r.queue_ms,
        )
        for r in m.ranked
    ]
    return RouteResult(ranked, match_from_proto(m.match))


def insert_from_proto(m: pb.InsertResponse) -> InsertResult:
    return InsertResult(
        already_present_pages=m.already_present_pages,
        existing_block_ids=list(m.existing_block_ids),
        new_pages=m.new_pages,
        replicated_pages=m.replicated_pages,
        evicted_bytes=m.evicted_bytes,
    )


def evict_from_proto(m: pb.EvictResponse) -> EvictResult:
    return EvictResult(m.evicted_bytes, m.evicted_pages, m.demoted_pages)


def stats_from_proto(m: pb.StatsResponse) -> Stats:
    c = m.counters
    return Stats(
        pools=[
            PoolStats(
                pool_from_proto(p.pool),
                p.capacity_bytes,
                p.used_bytes,
                p.pinned_bytes,
                p.pages,
                p.reserved_bytes,
                p.engine,
            )
            for p in m.pools
        ],
        namespaces=[
            NamespaceStats(
                namespace_from_proto(n.namespace),
                spec_from_proto(n.spec),
                n.bytes_per_token,
                n.bytes_per_page,
                n.pages,
                n.page_locations,
                n.radix_nodes,
                n.max_page_age_s,
                n.expired_pages,
            )
            for n in m.namespaces
        ],
        counters=Counters(
            match_requests=c.match_requests,
            requested_pages=c.requested_pages,
            matched_pages=c.matched_pages,
            inserted_pages=c.inserted_pages,
            evicted_pages=c.evicted_pages,
            evicted_bytes=c.evicted_bytes,
            pins_taken=c.pins_taken,
            pins_released=c.pins_released,
            lease_expiries=c.lease_expiries,
            requested_tokens=c.requested_tokens,
            matched_tokens=c.matched_tokens,
            eviction_regret_pages=c.eviction_regret_pages,
            demoted_pages=c.demoted_pages,
            dropped_pages=c.dropped_pages,
            expired_pages=c.expired_pages,
        ),
        active_pins=m.active_pins,
        policy=m.policy,
        limits=Limits(
            m.limits.max_tokens_per_request,
            m.limits.max_pages_per_request,
            m.limits.max_lease_ttl_ms,
            m.limits.default_lease_ttl_ms,
        ),
        agents=[
            AgentStats(
                agent_id=a.agent_id,
                device=a.device,
                epoch=a.epoch,
                alive=a.alive,
                last_heartbeat_age_ms=a.last_heartbeat_age_ms,
                tier=_enum(Tier, a.tier),
                used_bytes=a.used_bytes,
                free_blocks=a.free_blocks,
                heartbeats=a.heartbeats,
                block_agent_address=a.block_agent_address,
                data_address=a.data_address,
                transport=a.transport,
                pull_gbps=a.pull_gbps,
            )
            for a in m.agents
        ],
        tenants=[
            TenantStats(
                t.tenant,
                t.namespaces,
                t.stored_bytes,
                t.pinned_bytes,
                t.reserved_bytes,
                t.pins,
                t.max_bytes,
                t.max_pinned_bytes,
            )
            for t in m.tenants
        ],
        engines=[
            EngineStats(
                e.engine_id,
                namespace_from_proto(e.namespace),
                e.session,
                e.sequence,
                e.last_publish_age_ms,
                e.ttl_ms,
                e.pages,
            )
            for e in m.engines
        ],
        selection=selection_from_proto(m.selection) if m.HasField("selection") else None,
    )


def selection_from_proto(m: pb.PolicySelection) -> PolicySelection:
    return PolicySelection(
        active=m.active,
        candidates=[PolicyCandidate(c.name, c.shadow_hit_rate) for c in m.candidates],
        switches=m.switches,
        sampled_lookup_pages=m.sampled_lookup_pages,
        sampled_store_pages=m.sampled_store_pages,
        shadow_pages=m.shadow_pages,
        pools=m.pools,
        min_sample_rate=m.min_sample_rate,
    )


def event_from_proto(m: pb.CacheEvent) -> CacheEvent:
    return CacheEvent(
        kind=_enum(EventKind, m.kind),
        reason=_enum(EventReason, m.reason),
        namespace=namespace_from_proto(m.namespace),
        pool=pool_from_proto(m.pool),
        page_hashes=decode_page_hashes(m.page_hashes),
        sequence=m.sequence,
    )
