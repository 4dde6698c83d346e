"""Decoding SGLang's KV-cache event batches (the payload frame of its ZMQ publisher).

SGLang 0.5.23 (sglang/srt/disaggregation/kv_events.py) encodes a `KVEventBatch` with msgspec
msgpack as an array `[ts, events, attn_dp_rank]`, each event a tagged map
`{"type": "BlockStored", ...}` whose None fields are left out (omit_defaults). The frames
around it are vLLM >= 0.26's (kvcm.engines.wire). Fields this module does not know are named
in `unknown_fields` and otherwise ignored; anything else raises `EventDecodeError`
(docs/ENGINES.md, "SGLang").
"""

from __future__ import annotations

from typing import Any

from kvcm.engines.events import (AllBlocksCleared, BlockRemoved, BlockStored, Event,
                                 EventBatch, EventDecodeError, as_hash, as_hashes, as_int,
                                 as_list, decode_events, opt_int, opt_str, unknown)
from kvcm.engines.kinds import EngineKind
from kvcm.sglang.pagehash import verify_block

_KNOWN_STORED = frozenset(("type", "block_hashes", "parent_block_hash", "token_ids",
                           "block_size", "lora_id", "medium", "cache_salt", "session_id",
                           "lora_name"))
_KNOWN_REMOVED = frozenset(("type", "block_hashes", "medium"))


def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one payload frame. Raises EventDecodeError, never anything else."""
    return decode_events(payload, _event, "attn_dp_rank")


def _event(raw: Any, index: int) -> Event:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise EventDecodeError(f"event {index} is not a tagged map (SGLang >= 0.5 sends "
                               "{'type': ..., field: value})")
    tag = raw["type"]
    if tag == "BlockStored":
        return _stored(raw, index)
    if tag == "BlockRemoved":
        return BlockRemoved(as_hashes(raw.get("block_hashes"), index),
                            opt_str(raw.get("medium"), "medium"),
                            unknown_fields=unknown(raw, _KNOWN_REMOVED))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"event {index}: unknown event type {tag!r}")


def _stored(f: dict[str, Any], index: int) -> BlockStored:
    hashes = as_hashes(f.get("block_hashes"), index)
    parent = f.get("parent_block_hash")
    parent = None if parent is None else as_hash(parent, index)
    salt = opt_str(f.get("cache_salt"), "cache_salt")
    raw_tokens = as_list(f.get("token_ids"), index)
    refused = None
    if any(isinstance(t, list) for t in raw_tokens):
        # EAGLE bigram keys: each position is a (token, next token) pair, hashed as such.
        refused, tokens = "bigram", ()
    else:
        tokens = tuple(as_int(t, "token_ids") for t in raw_tokens)
    block_size = as_int(f.get("block_size"), "block_size")
    if block_size < 0:
        raise EventDecodeError(f"event {index}: block_size {block_size}")
    # The salt seeds SGLang's whole chain; kvcm keys it on a prompt's first block, as vLLM's.
    extras = tuple((salt,) if i == 0 and parent is None and salt is not None else None
                   for i in range(len(hashes)))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=opt_int(f.get("lora_id"), "lora_id"),
        medium=opt_str(f.get("medium"), "medium"),
        lora_name=opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=extras,
        session_id=opt_str(f.get("session_id"), "session_id"),
        unknown_fields=unknown(f, _KNOWN_STORED),
        refused=refused,
    )


KIND = EngineKind("sglang", decode_batch, verify_block)
