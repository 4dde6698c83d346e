"""Decoding vLLM's KV-cache event batches (the payload frame of its ZMQ publisher).

vLLM encodes a `KVEventBatch` with msgspec msgpack. Every release seen so far sends one of:

- batch: an array `[ts, events]` (early releases), `[ts, events, data_parallel_rank]`, or a
  map `{"ts": ..., "events": [...], "data_parallel_rank": ...}`;
- each event: a tagged array `["BlockStored", field, field, ...]` (fields in declaration
  order, releases before vLLM PR #42892) or a tagged map `{"type": "BlockStored", ...}`.

Fields a release does not send are None; fields this module does not know are named in the
event's `unknown_fields` (the mirror counts them) and otherwise ignored, so newer releases
decode as long as the fields below keep their meaning. Anything else raises
`EventDecodeError` (docs/ENGINES.md has the field tables and the sources they come from).
"""

from __future__ import annotations

from typing import Any

from kvcm.engines.events import (AllBlocksCleared, BlockHash, BlockRemoved, BlockStored,
                                 Event, EventBatch, EventDecodeError, as_hash, as_hashes,
                                 as_int, as_list, decode_events, opt_int, opt_str, unknown)
from kvcm.engines.kinds import EngineKind

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "Event",
           "EventBatch", "EventDecodeError", "decode_batch"]

# Positional field order of the tagged-array form, as declared in vllm/distributed/kv_events.py.
# Later releases append fields, so a shorter array is an older release.
# vLLM 0.9 - 0.10 send the first five of BlockStored and the first of BlockRemoved; 0.22 - 0.23
# (the last array releases) send all of them (docs/ENGINES.md, "vLLM's wire format").
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Fields of the map form this module knows (docs/ENGINES.md, "Event fields by release");
# any other is reported in `unknown_fields` and otherwise ignored.
_KNOWN_STORED = frozenset(_STORED_FIELDS + (
    "type", "locality", "ownership", "session_id", "lookahead_token_ids"))
_KNOWN_REMOVED = frozenset(_REMOVED_FIELDS + (
    "type", "locality", "ownership", "remaining_copy_counts"))

_MAX_EXTRA_DEPTH = 8


def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one payload frame. Raises EventDecodeError, never anything else."""
    return decode_events(payload, _event, "data_parallel_rank")


def _fields(raw: Any, index: int, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of a tagged array or tagged map. Array elements past `names`
    are named "#<position>"."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError(f"event {index}: tagged array without a string tag")
        f = dict(zip(names, raw[1:]))
        for i in range(len(names) + 1, len(raw)):
            f[f"#{i}"] = raw[i]
        return raw[0], f
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise EventDecodeError(f"event {index}: map without a string 'type'")
        return tag, raw
    raise EventDecodeError(f"event {index} is a {type(raw).__name__}, expected array or map")


def _event(raw: Any, index: int) -> Event:
    tag = raw[0] if isinstance(raw, list) and raw else (
        raw.get("type") if isinstance(raw, dict) else None)
    if tag == "BlockStored":
        _, f = _fields(raw, index, _STORED_FIELDS)
        return _stored(f, index)
    if tag == "BlockRemoved":
        _, f = _fields(raw, index, _REMOVED_FIELDS)
        hashes = as_hashes(f.get("block_hashes"), index)
        counts = f.get("remaining_copy_counts")
        if counts is not None:
            counts = tuple(as_int(c, "remaining_copy_counts") for c in as_list(counts, index))
            if len(counts) != len(hashes) or any(c < 0 for c in counts):
                raise EventDecodeError(f"event {index}: remaining_copy_counts does not "
                                       "match block_hashes")
        return BlockRemoved(hashes, opt_str(f.get("medium"), "medium"),
                            opt_int(f.get("group_idx"), "group_idx"),
                            opt_str(f.get("locality"), "locality"), counts,
                            opt_str(f.get("ownership"), "ownership"),
                            unknown(f, _KNOWN_REMOVED))
    if tag == "AllBlocksCleared":
        _fields(raw, index, ())
        return AllBlocksCleared()
    _fields(raw, index, ())  # raises for a missing or non-string tag
    raise EventDecodeError(f"event {index}: unknown event type {tag!r}")


def _stored(f: dict[str, Any], index: int) -> BlockStored:
    hashes = as_hashes(f.get("block_hashes"), index)
    block_size = as_int(f.get("block_size"), "block_size")
    tokens = tuple(as_int(t, "token_ids") for t in as_list(f.get("token_ids"), index))
    if block_size < 0:
        raise EventDecodeError(f"event {index}: block_size {block_size}")
    extras = f.get("extra_keys")
    if extras is not None:
        extras = tuple(None if e is None else _extra(e, index, 0) for e in as_list(extras, index))
        if len(extras) != len(hashes):
            raise EventDecodeError(f"event {index}: {len(extras)} extra_keys for "
                                   f"{len(hashes)} block_hashes")
    lookahead = f.get("lookahead_token_ids")
    if lookahead is not None:
        lookahead = tuple(tuple(as_int(t, "lookahead_token_ids") for t in as_list(b, index))
                          for b in as_list(lookahead, index))
        if len(lookahead) != len(hashes):
            raise EventDecodeError(f"event {index}: {len(lookahead)} lookahead_token_ids for "
                                   f"{len(hashes)} block_hashes")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else as_hash(parent, index),
        token_ids=tokens,
        block_size=block_size,
        lora_id=opt_int(f.get("lora_id"), "lora_id"),
        medium=opt_str(f.get("medium"), "medium"),
        lora_name=opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=extras,
        group_idx=opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        locality=opt_str(f.get("locality"), "locality"),
        kv_cache_spec_sliding_window=opt_int(f.get("kv_cache_spec_sliding_window"),
                                              "kv_cache_spec_sliding_window"),
        ownership=opt_str(f.get("ownership"), "ownership"),
        session_id=opt_str(f.get("session_id"), "session_id"),
        lookahead_token_ids=lookahead,
        unknown_fields=unknown(f, _KNOWN_STORED),
        keys_published="extra_keys" in f or "type" in f,
    )


def _extra(v: Any, index: int, depth: int) -> Any:
    """An extra key with arrays turned into tuples (msgpack has no tuple)."""
    if depth > _MAX_EXTRA_DEPTH:
        raise EventDecodeError(f"event {index}: extra_keys nested too deep")
    if isinstance(v, list):
        return tuple(_extra(x, index, depth + 1) for x in v)
    if v is None or isinstance(v, (str, bytes, int, float, bool)):
        return v
    raise EventDecodeError(f"event {index}: extra key of type {type(v).__name__}")


KIND = EngineKind("vllm", decode_batch)
