"""vLLM integration: mirror a vLLM engine's prefix cache into kvcm from its KV events.

`kvcm-vllm-bridge` (kvcm.vllm.bridge) subscribes to engines' ZMQ event streams and publishes
their caches to the manager as engine pools; `hash_request` hashes a request the way the
bridge hashes the engine's blocks of it, so a router can match it (docs/ENGINES.md).
"""

from kvcm.vllm.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                              EventDecodeError, decode_batch)
from kvcm.vllm.mirror import Change, ChangeKind, EngineMirror, Tier, tier_of_medium
from kvcm.vllm.pagehash import blocks_per_page, canonical_extras, hash_request

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "Change", "ChangeKind", "EngineMirror",
    "EventBatch", "EventDecodeError", "Tier", "blocks_per_page", "canonical_extras",
    "decode_batch", "hash_request", "tier_of_medium",
]
