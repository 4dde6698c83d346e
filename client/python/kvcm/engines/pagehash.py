"""kvcm page hashes of engine blocks, extra keys included (docs/HASHING.md, "Engine extra keys").

Engines mix per-block *extra keys* into their block hashes. vLLM mixes the LoRA adapter,
multimodal inputs, the request's `cache_salt` (first block only) and prompt-embedding
digests. Two requests with the same tokens but different extra keys must never share a kvcm
page, so a page whose blocks carry extra keys chains from a mixed predecessor:

    prev' = SipHash128(key_ns, "kvcm/extra/v1" || prev || canonical(extras of the page's blocks))
    h_i   = hash_page(key_ns, prev', tokens of page i)

A page without extra keys hashes exactly as a plain kvcm page (prev' = prev), so an unsalted
prompt sent as tokens to the manager matches it. SGLang's cache salt seeds its whole chain;
its decoder puts it on a prompt's first block as vLLM does, so one `hash_request` serves both.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, Optional, Tuple

from kvcm import hashing

EXTRA_DOMAIN = b"kvcm/extra/v1"

# Per block: a tuple of extra keys, or None for none.
BlockExtras = Optional[Tuple[Any, ...]]

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST = range(8)
_INT_MIN, _INT_MAX = -(1 << 127), (1 << 127) - 1


def _encode(v: Any, out: bytearray, depth: int = 0) -> None:
    if depth > 16:
        raise ValueError("extra key nested too deep")
    if v is None:
        out.append(_NONE)
    elif v is True or v is False:
        out.append(_TRUE if v else _FALSE)
    elif isinstance(v, int):
        if not _INT_MIN <= v <= _INT_MAX:
            raise ValueError(f"extra key integer {v} out of range")
        out.append(_INT)
        out += (v & ((1 << 128) - 1)).to_bytes(16, "little")
    elif isinstance(v, float):
        if math.isnan(v):
            raise ValueError("extra key is NaN")
        out.append(_FLOAT)
        out += struct.pack("<d", v)
    elif isinstance(v, str):
        b = v.encode("utf-8")
        out.append(_STR)
        out += struct.pack("<I", len(b)) + b
    elif isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        out.append(_BYTES)
        out += struct.pack("<I", len(b)) + b
    elif isinstance(v, (tuple, list)):
        out.append(_LIST)
        out += struct.pack("<I", len(v))
        for x in v:
            _encode(x, out, depth + 1)
    else:
        raise ValueError(f"extra key of type {type(v).__name__}")


def normalize_extras(extras: Any) -> BlockExtras:
    """One block's extra keys as the hash sees them: None for none (an empty tuple too)."""
    if extras is None:
        return None
    t = tuple(extras)
    return t or None


def canonical_extras(page_extras: Sequence[BlockExtras]) -> bytes:
    """The canonical bytes of the extra keys of one page's blocks (one entry per block)."""
    out = bytearray()
    _encode([normalize_extras(e) for e in page_extras], out)
    return bytes(out)


def mixed_prev(ns_key: bytes, prev: bytes, page_extras: Sequence[BlockExtras]) -> bytes:
    """The predecessor a page chains from: `prev` itself when no block has extra keys."""
    if all(normalize_extras(e) is None for e in page_extras):
        return prev
    return hashing.siphash128(ns_key, EXTRA_DOMAIN + prev + canonical_extras(page_extras))


def page_hash(ns_key: bytes, prev: bytes, tokens: Sequence[int],
              page_extras: Sequence[BlockExtras]) -> bytes:
    """kvcm hash of one page (all its tokens, one extras entry per engine block in it)."""
    return hashing.hash_page(ns_key, mixed_prev(ns_key, prev, page_extras), list(tokens))


def blocks_per_page(page_size: int, block_size: int) -> int:
    """k with page_size == k * block_size; ValueError naming both sizes otherwise."""
    if block_size <= 0 or page_size <= 0 or page_size % block_size != 0:
        raise ValueError(
            f"namespace page size {page_size} tokens is not a multiple of the engine's block "
            f"size {block_size} tokens: a kvcm page must be whole engine blocks")
    return page_size // block_size


def request_block_extras(num_blocks: int, lora_name: str | None = None,
                         cache_salt: str | None = None,
                         lora_id: int | None = None) -> list[BlockExtras]:
    """Per-block extra keys vLLM gives a text request (vllm/v1/core/kv_cache_utils.py,
    generate_block_hash_extra_keys): the LoRA name on every block (or, for releases that
    keyed on it, the integer LoRA id), then the cache salt on the first block only."""
    lora: list[Any] = [lora_name] if lora_name else ([lora_id] if lora_id is not None else [])
    out: list[BlockExtras] = []
    for i in range(num_blocks):
        keys = lora + ([cache_salt] if i == 0 and cache_salt else [])
        out.append(tuple(keys) or None)
    return out


def hash_request(ns_key: bytes, token_ids: Sequence[int], page_size: int, block_size: int,
                 lora_name: str | None = None, cache_salt: str | None = None,
                 lora_id: int | None = None,
                 block_extras: Sequence[BlockExtras] | None = None) -> list[bytes]:
    """kvcm page hashes of a request as kvcm-bridge publishes the engine's blocks of
    it: one per whole page. `block_extras` (one entry per whole block) replaces the keys built
    from lora_name / lora_id / cache_salt, e.g. for multimodal requests."""
    k = blocks_per_page(page_size, block_size)
    pages = len(token_ids) // page_size
    if block_extras is None:
        block_extras = request_block_extras(pages * k, lora_name, cache_salt, lora_id)
    elif len(block_extras) < pages * k:
        raise ValueError(f"block_extras has {len(block_extras)} entries for {pages * k} blocks")
    out: list[bytes] = []
    prev = hashing.ZERO_HASH
    for p in range(pages):
        prev = page_hash(ns_key, prev, token_ids[p * page_size:(p + 1) * page_size],
                         block_extras[p * k:(p + 1) * k])
        out.append(prev)
    return out
