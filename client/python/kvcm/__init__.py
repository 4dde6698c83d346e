"""kvcm: Python client of the kvcm KV-cache prefix manager.

    import kvcm
    client = kvcm.Client("127.0.0.1:50051", insecure=True)
    ns = kvcm.Namespace("acme", "deepseek-v3")
    client.register_model(ns, kvcm.ModelSpec.deepseek_v3())
    with client.match_and_pin(ns, tokens) as prefix:
        print(prefix.match.matched_tokens, prefix.match.pages)

kvcm.aio.Client is the asyncio twin; kvcm.hashing the page hash.
"""

from kvcm import hashing
from kvcm._options import ClientOptions
from kvcm.client import Client, EventStream, PinnedPrefix
from kvcm.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvcmError,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from kvcm.types import (
    CATALOG,
    PENDING_BLOCK_ID,
    AgentStats,
    AttentionKind,
    CacheEvent,
    ClientCounters,
    Counters,
    DeleteNamespaceResult,
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
    RegisterModelResult,
    Replica,
    RouteCandidate,
    RoutePolicy,
    RouteResult,
    Segment,
    Stats,
    TenantStats,
    Tier,
)

from kvcm import aio  # noqa: E402  (after Client: kvcm.aio imports kvcm.client)

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AgentStats",
    "AlreadyExists",
    "AttentionKind",
    "CATALOG",
    "CacheEvent",
    "Cancelled",
    "Client",
    "ClientCounters",
    "ClientOptions",
    "Counters",
    "DataLoss",
    "DeadlineExceeded",
    "DeleteNamespaceResult",
    "EventKind",
    "EventReason",
    "EventStream",
    "EngineStats",
    "EvictResult",
    "FailedPrecondition",
    "InsertResult",
    "Internal",
    "InvalidArgument",
    "KvDtype",
    "KvcmError",
    "Limits",
    "MatchResult",
    "ModelSpec",
    "Namespace",
    "NamespaceStats",
    "NotFound",
    "OutOfRange",
    "PENDING_BLOCK_ID",
    "PageReplica",
    "PermissionDenied",
    "PinnedPrefix",
    "PolicyCandidate",
    "PolicySelection",
    "PoolRef",
    "PoolStats",
    "RankedAgent",
    "RegisterModelResult",
    "Replica",
    "ResourceExhausted",
    "RouteCandidate",
    "RoutePolicy",
    "RouteResult",
    "Segment",
    "Stats",
    "TenantStats",
    "Tier",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "aio",
    "hashing",
]
