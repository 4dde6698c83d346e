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

import math
from dataclasses import dataclass
from typing import Any, Union

import msgspec

# A vLLM block hash: the low 64 bits of its digest as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
# the default), the whole digest as bytes, or, in early releases, Python's hash() of a tuple.
BlockHash = Union[int, bytes]

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


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch this module understands."""


@dataclass(frozen=True)
class BlockStored:
    """The engine cached full blocks `block_hashes` (a chain: each block's parent is the
    previous one, the first one's is `parent_block_hash`, None at a prompt's start)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # Tokens of every block, block after block: len == len(block_hashes) * block_size, or
    # empty when the publisher did not send them (offloading connectors).
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: the extra keys vLLM mixed into that block's hash, or None.
    # None as a whole when the release does not send them.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # "LOCAL" / "REMOTE" relative to the publisher, where a release says.
    locality: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM >= 0.30: the secondary offloading tier, and the request session that stored or
    # re-reported the block. Neither changes what the block holds.
    ownership: str | None = None
    session_id: str | None = None
    # vLLM >= 0.33: per block, the tokens after it that its hash also covers (EAGLE-style
    # speculative decoding with prefix caching); None when lookahead hashing is off.
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Names of fields this module does not know (positions, for the array form).
    unknown_fields: tuple[str, ...] = ()
    # False for releases that send no extra_keys field (vLLM < 0.17, arrays of < 8 fields):
    # salts and multimodal inputs are in vLLM's hash but not in the event.
    keys_published: bool = True


@dataclass(frozen=True)
class BlockRemoved:
    """The engine dropped one cached copy of each block (vLLM does not deduplicate: two
    physical blocks may hold the same hash, each stored and removed on its own)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    # Copies of each hash still held after the removal, where the release says.
    remaining_copy_counts: tuple[int, ...] | None = None
    ownership: str | None = None
    unknown_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one payload frame. Raises EventDecodeError, never anything else."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise EventDecodeError(f"not msgpack: {e}") from None
    try:
        return _batch(raw)
    except EventDecodeError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise EventDecodeError(f"malformed batch: {e!r}") from None


def _batch(raw: Any) -> EventBatch:
    if isinstance(raw, list):
        if len(raw) < 2:
            raise EventDecodeError(f"batch array has {len(raw)} elements, expected >= 2")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise EventDecodeError("batch map has no 'events'")
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise EventDecodeError(f"batch is a {type(raw).__name__}, expected array or map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
        raise EventDecodeError(f"batch ts is {ts!r}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events is a {type(events).__name__}, expected array")
    return EventBatch(float(ts), tuple(_event(e, i) for i, e in enumerate(events)),
                      _opt_int(rank, "data_parallel_rank"))


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
        hashes = _hashes(f.get("block_hashes"), index)
        counts = f.get("remaining_copy_counts")
        if counts is not None:
            counts = tuple(_int(c, "remaining_copy_counts") for c in _list(counts, index))
            if len(counts) != len(hashes) or any(c < 0 for c in counts):
                raise EventDecodeError(f"event {index}: remaining_copy_counts does not "
                                       "match block_hashes")
        return BlockRemoved(hashes, _opt_str(f.get("medium"), "medium"),
                            _opt_int(f.get("group_idx"), "group_idx"),
                            _opt_str(f.get("locality"), "locality"), counts,
                            _opt_str(f.get("ownership"), "ownership"),
                            _unknown(f, _KNOWN_REMOVED))
    if tag == "AllBlocksCleared":
        _fields(raw, index, ())
        return AllBlocksCleared()
    _fields(raw, index, ())  # raises for a missing or non-string tag
    raise EventDecodeError(f"event {index}: unknown event type {tag!r}")


def _stored(f: dict[str, Any], index: int) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"), index)
    block_size = _int(f.get("block_size"), "block_size")
    tokens = tuple(_int(t, "token_ids") for t in _list(f.get("token_ids"), index))
    if block_size < 0:
        raise EventDecodeError(f"event {index}: block_size {block_size}")
    extras = f.get("extra_keys")
    if extras is not None:
        extras = tuple(None if e is None else _extra(e, index, 0) for e in _list(extras, index))
        if len(extras) != len(hashes):
            raise EventDecodeError(f"event {index}: {len(extras)} extra_keys for "
                                   f"{len(hashes)} block_hashes")
    lookahead = f.get("lookahead_token_ids")
    if lookahead is not None:
        lookahead = tuple(tuple(_int(t, "lookahead_token_ids") for t in _list(b, index))
                          for b in _list(lookahead, index))
        if len(lookahead) != len(hashes):
            raise EventDecodeError(f"event {index}: {len(lookahead)} lookahead_token_ids for "
                                   f"{len(hashes)} block_hashes")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, index),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=extras,
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        locality=_opt_str(f.get("locality"), "locality"),
        kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window"),
                                              "kv_cache_spec_sliding_window"),
        ownership=_opt_str(f.get("ownership"), "ownership"),
        session_id=_opt_str(f.get("session_id"), "session_id"),
        lookahead_token_ids=lookahead,
        unknown_fields=_unknown(f, _KNOWN_STORED),
        keys_published="extra_keys" in f or "type" in f,
    )


def _unknown(f: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Names of the fields a release sent that this module does not know (None ones too)."""
    return tuple(sorted(str(k) for k in f if k not in known))


def _list(v: Any, index: int) -> list[Any]:
    if not isinstance(v, list):
        raise EventDecodeError(f"event {index}: expected an array, got {type(v).__name__}")
    return v


def _hash(v: Any, index: int) -> BlockHash:
    if isinstance(v, bytes) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise EventDecodeError(f"event {index}: block hash {v!r} is neither int nor bytes")


def _hashes(v: Any, index: int) -> tuple[BlockHash, ...]:
    return tuple(_hash(h, index) for h in _list(v, index))


def _extra(v: Any, index: int, depth: int) -> Any:
    """An extra key with arrays turned into tuples (msgpack has no tuple)."""
    if depth > _MAX_EXTRA_DEPTH:
        raise EventDecodeError(f"event {index}: extra_keys nested too deep")
    if isinstance(v, list):
        return tuple(_extra(x, index, depth + 1) for x in v)
    if v is None or isinstance(v, (str, bytes, int, float, bool)):
        return v
    raise EventDecodeError(f"event {index}: extra key of type {type(v).__name__}")


def _int(v: Any, name: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise EventDecodeError(f"{name} is {v!r}, expected an integer")


def _opt_int(v: Any, name: str) -> int | None:
    return None if v is None else _int(v, name)


def _opt_str(v: Any, name: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise EventDecodeError(f"{name} is {v!r}, expected a string")
