"""vLLM integration: mirror a vLLM engine's prefix cache into kvcm from its KV events.

`kvcm-vllm-bridge` (kvcm.vllm.bridge, the `bridge` extra) subscribes to engines' ZMQ event
streams and publishes their caches to the manager as engine pools. `hash_request` hashes a
request the way the bridge hashes the engine's blocks of it, so a router can match it
(docs/ENGINES.md); it needs no extra.
"""

from kvcm.vllm.pagehash import blocks_per_page, canonical_extras, hash_request

__all__ = ["blocks_per_page", "canonical_extras", "hash_request"]
