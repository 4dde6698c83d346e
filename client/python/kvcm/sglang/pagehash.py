"""SGLang's block hashes, recomputed from what its events carry (sglang 0.5.23).

SGLang hashes a page as SHA-256(prior digest || the page's token ids as little-endian u32)
(sglang/srt/mem_cache/cpp_utils/hash_binding.cpp; a page with a token above 2^32 - 1 hashes
0xff then little-endian u64s), chained from the previous page's digest, from none at a prompt's
start, or from SHA-256("sglang-cache-salt-v1\\0" || salt) for a salted request
(mem_cache/utils.py, compute_node_event_hash_values). It publishes the first 8 digest bytes
as a signed big-endian int64 (hash_str_to_int64), in the "dynamo" event format further
namespaced by the request's extra key and salt (disaggregation/kv_events.py,
namespaced_block_hash). `verify_block` checks a published hash against that; a block whose
hash took in something the event does not carry (an extra key) does not match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, Optional, Tuple

SALT_TAG = b"sglang-cache-salt-v1\0"
NAMESPACE_TAG = b"sglang-kv-event-namespace-v1"
_U32_MAX = (1 << 32) - 1
_I64_MAX = (1 << 63) - 1

# (this block's SHA-256 digest, the namespace seed its chain's published hashes carry or None)
State = Tuple[bytes, Optional[bytes]]


def page_digest(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """SGLang's digest of one page chained from `prior` (None at a prompt's start)."""
    if any(t < 0 or t > _I64_MAX for t in tokens):
        raise ValueError("token id must be a non-negative int64")
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    if any(t > _U32_MAX for t in tokens):
        h.update(b"\xff" + struct.pack(f"<{len(tokens)}Q", *tokens))
    elif tokens:
        h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def salt_digest(cache_salt: str) -> bytes:
    """The prior digest a salted request's first page chains from."""
    return hashlib.sha256(SALT_TAG + cache_salt.encode("utf-8")).digest()


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """kv_event_namespace_seed: what the "dynamo" format mixes into published hashes."""
    if extra_key is None and cache_salt is None:
        return None
    d = hashlib.sha256(NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            d.update(b"\x00")
        else:
            b = part.encode("utf-8")
            d.update(b"\x01" + len(b).to_bytes(8, "little") + b)
    return d.digest()


def published_hash(digest: bytes, seed: bytes | None = None) -> int:
    """The int64 SGLang publishes for a page digest (namespaced when `seed` is given)."""
    h = int.from_bytes(digest[:8], "big", signed=True)
    if seed is None:
        return h
    return int.from_bytes(hashlib.sha256(seed + h.to_bytes(8, "big", signed=True)).digest()[:8],
                          "big", signed=True)


def chain_hashes(tokens: Sequence[int], page_size: int, cache_salt: str | None = None,
                 dynamo: bool = False) -> list[int]:
    """The hashes SGLang publishes for a prompt's whole pages (a router or a test's oracle)."""
    prior = salt_digest(cache_salt) if cache_salt is not None else None
    seed = namespace_seed(None, cache_salt) if dynamo else None
    out = []
    for i in range(len(tokens) // page_size):
        prior = page_digest(prior, tokens[i * page_size:(i + 1) * page_size])
        out.append(published_hash(prior, seed))
    return out


def verify_block(parent: State | None, tokens: tuple[int, ...], extras: Any,
                 published: Any) -> State | None:
    """kvcm.engines.kinds.VerifyBlock for SGLang. `extras` of a prompt's first block is
    (cache_salt,) for a salted request (kvcm.sglang.events puts it there)."""
    try:
        if parent is None:
            salt = extras[0] if extras else None
            digest = page_digest(salt_digest(salt) if salt is not None else None, tokens)
            if published == published_hash(digest):
                return digest, None
            seed = namespace_seed(None, salt) if salt is not None else None
            if seed is not None and published == published_hash(digest, seed):
                return digest, seed
            return None
        digest = page_digest(parent[0], tokens)
        return (digest, parent[1]) if published == published_hash(digest, parent[1]) else None
    except (ValueError, TypeError, struct.error):
        return None
