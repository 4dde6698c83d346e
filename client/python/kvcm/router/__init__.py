"""kvcm.router: a KV-aware router for OpenAI-compatible inference engines (docs/ROUTER.md).

`Router` chooses an engine per request with a policy (kv-aware over the manager's Route,
round-robin, consistent-hash, least-loaded) and tracks what it sent each engine;
`kvcm-router` (kvcm.router.server) serves it over HTTP. Needs the `router` extra.
"""

from kvcm.router.core import Routed, Router, make_policy
from kvcm.router.load import LoadTracker, Ticket
from kvcm.router.policy import (
    POLICIES,
    ConsistentHashPolicy,
    Decision,
    HashRing,
    ImbalanceGuard,
    IndexUnavailable,
    KvAwarePolicy,
    LeastLoadedPolicy,
    Policy,
    PrefixIndex,
    RoundRobinPolicy,
    RoutingRequest,
    cacheable_tokens,
)
from kvcm.router.tokenizer import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    TokenizerError,
    WordTokenizer,
    load_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "ConsistentHashPolicy",
    "Decision",
    "HashRing",
    "HuggingFaceTokenizer",
    "ImbalanceGuard",
    "IndexUnavailable",
    "KvAwarePolicy",
    "LeastLoadedPolicy",
    "LoadTracker",
    "POLICIES",
    "Policy",
    "PrefixIndex",
    "RoundRobinPolicy",
    "Routed",
    "Router",
    "RoutingRequest",
    "Ticket",
    "Tokenizer",
    "TokenizerError",
    "WordTokenizer",
    "cacheable_tokens",
    "load_tokenizer",
    "make_policy",
]
