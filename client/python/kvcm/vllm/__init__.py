"""vLLM's side of kvcm: its KV-event wire format (kvcm.vllm.events) and the KV connector.

The bridge itself is engine-neutral (kvcm.engines; `kvcm-vllm-bridge` is `kvcm-bridge`).
`hash_request` and friends are re-exported from kvcm.engines for code written against them.
"""

from kvcm.engines.pagehash import blocks_per_page, canonical_extras, hash_request

__all__ = ["blocks_per_page", "canonical_extras", "hash_request"]
