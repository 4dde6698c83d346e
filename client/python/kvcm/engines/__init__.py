"""Engine-neutral integration: mirror engines' prefix caches into kvcm from their KV events.

`kvcm-bridge` (kvcm.engines.bridge, the `bridge` extra) subscribes to engines' ZMQ event
streams and publishes their caches to the manager as engine pools; each engine's `kind`
(kvcm.engines.kinds: "vllm", "sglang") picks the decoder of its events. `hash_request` hashes
a request the way the bridge hashes the engine's blocks of it, so a router can match it
(docs/ENGINES.md); it needs no extra.
"""

from kvcm.engines.pagehash import blocks_per_page, canonical_extras, hash_request

__all__ = ["blocks_per_page", "canonical_extras", "hash_request"]
