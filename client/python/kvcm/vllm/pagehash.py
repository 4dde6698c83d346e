"""kvcm page hashes of engine blocks: moved to kvcm.engines.pagehash (vLLM's extra-key rules
and every other engine's share it); re-exported here for code written against this path."""

from kvcm.engines.pagehash import (EXTRA_DOMAIN, BlockExtras, blocks_per_page,
                                   canonical_extras, hash_request, mixed_prev,
                                   normalize_extras, page_hash, request_block_extras)

__all__ = ["EXTRA_DOMAIN", "BlockExtras", "blocks_per_page", "canonical_extras",
           "hash_request", "mixed_prev", "normalize_extras", "page_hash",
           "request_block_extras"]
