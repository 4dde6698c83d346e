"""The engine-neutral KV-cache events the mirror applies, and helpers engine decoders share.

Every engine kind (kvcm.vllm, kvcm.sglang) decodes its own payloads into these records;
`EngineMirror` knows nothing else. Fields an engine does not send stay None. A decoder raises
`EventDecodeError` for a payload it cannot read, and names fields it does not know in
`unknown_fields` (the mirror counts them) rather than failing on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Union

import msgspec

# An engine's block hash: an int (vLLM's low 64 bits, SGLang's signed int64) or bytes.
BlockHash = Union[int, bytes]


class EventDecodeError(ValueError):
    """A payload that is not an event batch the engine kind's decoder understands."""


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
    # One entry per block: the extra keys the engine mixed into that block's hash, or None.
    # None as a whole when the release does not send them.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # "LOCAL" / "REMOTE" relative to the publisher, where a release says.
    locality: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM >= 0.30: the secondary offloading tier, and the request session that stored or
    # re-reported the block (SGLang sends session_id too). Neither changes what a block holds.
    ownership: str | None = None
    session_id: str | None = None
    # vLLM >= 0.33: per block, the tokens after it that its hash also covers (EAGLE-style
    # speculative decoding with prefix caching); None when lookahead hashing is off.
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Names of fields the decoder does not know (positions, for array forms).
    unknown_fields: tuple[str, ...] = ()
    # False for releases that send no extra keys (vLLM < 0.17, arrays of < 8 fields): salts
    # and multimodal inputs are in the engine's hash but not in the event.
    keys_published: bool = True
    # Set by a decoder that already knows kvcm cannot mirror these blocks (the reason the
    # mirror counts them under, e.g. "bigram" for SGLang's EAGLE bigram keys).
    refused: str | None = None


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
    # vLLM's data_parallel_rank, SGLang's attn_dp_rank: the rank whose cache this is.
    data_parallel_rank: int | None = None


# ---- helpers for decoders ---------------------------------------------------------------

_decoder = msgspec.msgpack.Decoder()

# What a malformed structure raises inside a decoder; decode() turns it into EventDecodeError.
MALFORMED = (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError)


def msgpack(payload: bytes) -> Any:
    """The payload as plain msgpack values; EventDecodeError if it is not msgpack."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise EventDecodeError(f"not msgpack: {e}") from None


def batch_header(raw: Any) -> tuple[float, list[Any], Any]:
    """(ts, events, rank) of a batch array `[ts, events(, rank)]` or map {ts, events, rank}."""
    if isinstance(raw, list):
        if len(raw) < 2:
            raise EventDecodeError(f"batch array has {len(raw)} elements, expected >= 2")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise EventDecodeError("batch map has no 'events'")
        ts, events = raw.get("ts", 0.0), raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise EventDecodeError(f"batch is a {type(raw).__name__}, expected array or map")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
        raise EventDecodeError(f"batch ts is {ts!r}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events is a {type(events).__name__}, expected array")
    return float(ts), events, rank


def decode_events(payload: bytes, event: Callable[[Any, int], "Event"],
                  rank_name: str) -> EventBatch:
    """One payload frame `[ts, events, rank]` whose events `event(raw, index)` decodes (an
    engine's decoder); rank_name names the rank in errors. Raises EventDecodeError, never
    anything else."""
    raw = msgpack(payload)
    try:
        ts, events, rank = batch_header(raw)
        return EventBatch(ts, tuple(event(e, i) for i, e in enumerate(events)),
                          opt_int(rank, rank_name))
    except EventDecodeError:
        raise
    except MALFORMED as e:
        raise EventDecodeError(f"malformed batch: {e!r}") from None


def unknown(f: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """Names of the fields a release sent that the decoder does not know (None ones too)."""
    return tuple(sorted(str(k) for k in f if k not in known))


def as_list(v: Any, index: int) -> list[Any]:
    if not isinstance(v, list):
        raise EventDecodeError(f"event {index}: expected an array, got {type(v).__name__}")
    return v


def as_hash(v: Any, index: int) -> BlockHash:
    if isinstance(v, bytes) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise EventDecodeError(f"event {index}: block hash {v!r} is neither int nor bytes")


def as_hashes(v: Any, index: int) -> tuple[BlockHash, ...]:
    return tuple(as_hash(h, index) for h in as_list(v, index))


def as_int(v: Any, name: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise EventDecodeError(f"{name} is {v!r}, expected an integer")


def opt_int(v: Any, name: str) -> int | None:
    return None if v is None else as_int(v, name)


def opt_str(v: Any, name: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise EventDecodeError(f"{name} is {v!r}, expected a string")
