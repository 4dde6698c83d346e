"""Decoding vLLM KV event batches: the three struct generations, unknown fields, garbage."""

import msgspec
import pytest

from kvcm.testing.fake_vllm import FORMS, encode_batch
from kvcm.vllm.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError,
                              decode_batch)

STORED = BlockStored(
    block_hashes=(0xDEADBEEF12345678, 0xFFFFFFFFFFFFFFFF), parent_block_hash=7,
    token_ids=tuple(range(100, 132)), block_size=16, lora_id=3, medium="CPU",
    lora_name="adapter", extra_keys=(("adapter", "salt-1"), ("adapter",)), group_idx=0,
    kv_cache_spec_kind="full_attention")
REMOVED = BlockRemoved(block_hashes=(0x8000000000000001,), medium="GPU", group_idx=0)


@pytest.mark.parametrize("form", FORMS)
def test_each_form_round_trips_what_it_carries(form):
    batch = decode_batch(encode_batch(form, [STORED, REMOVED, AllBlocksCleared()], ts=12.5,
                                      data_parallel_rank=2))
    assert batch.ts == 12.5
    stored, removed, cleared = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == STORED.block_hashes
    assert stored.parent_block_hash == 7
    assert stored.token_ids == STORED.token_ids
    assert stored.block_size == 16 and stored.lora_id == 3
    assert removed.block_hashes == REMOVED.block_hashes
    assert batch.data_parallel_rank == 2  # every release since 0.9 sends the rank
    if form == "legacy":  # vLLM 0.9: no medium, lora_name, extra_keys
        assert stored.medium is None and stored.lora_name is None
        assert stored.extra_keys is None and stored.group_idx is None
        assert removed.medium is None
    else:
        assert stored.medium == "CPU" and stored.lora_name == "adapter"
        assert stored.extra_keys == STORED.extra_keys
        assert stored.group_idx == 0 and removed.medium == "GPU"
    assert stored.kv_cache_spec_kind == (None if form == "legacy" else "full_attention")


def test_bytes_hashes_and_null_extras():
    ev = BlockStored((bytes(range(32)),), bytes(range(100, 132)), tuple(range(16)), 16,
                     medium="GPU", extra_keys=(None,))
    (got,) = decode_batch(encode_batch("map", [ev])).events
    assert got.block_hashes == (bytes(range(32)),)
    assert got.parent_block_hash == bytes(range(100, 132))
    assert got.extra_keys == (None,)


def test_map_batch_and_unknown_fields_are_accepted():
    # A batch map (EventBatch without array_like), fields from the future in events and batch.
    raw = {"ts": 1.0, "data_parallel_rank": 1, "future": [1, 2], "events": [
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "extra_keys": [["mm-hash", 0]], "group_idx": 0,
         "kv_cache_spec_sliding_window": None, "locality": "LOCAL", "event_version": 1},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU",
         "remaining_copy_counts": [0], "something": "new"},
        ["BlockRemoved", [6], "GPU", 0, "extra positional field"],
    ]}
    batch = decode_batch(msgspec.msgpack.encode(raw))
    stored, removed, removed2 = batch.events
    assert batch.data_parallel_rank == 1
    assert stored.extra_keys == (("mm-hash", 0),) and stored.locality == "LOCAL"
    assert removed.remaining_copy_counts == (0,)
    assert removed2.block_hashes == (6,) and removed2.group_idx == 0


@pytest.mark.parametrize("payload", [
    b"",                                    # empty frame
    b"\xc1",                                # never-used msgpack byte
    b"not msgpack at all \xff\xfe",
    msgspec.msgpack.encode(42),             # not a batch
    msgspec.msgpack.encode([1.0]),          # too short
    msgspec.msgpack.encode(["x", []]),      # ts not a number
    msgspec.msgpack.encode([1.0, {"a": 1}]),  # events not an array
    msgspec.msgpack.encode([1.0, [["NoSuchEvent", 1]]]),
    msgspec.msgpack.encode([1.0, [[17, 1]]]),  # tag not a string
    msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),  # map without type
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], "16", None]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1], 1, None]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, None, None,
                                   [["a"], ["b"]]]]]),   # 2 extra_keys for 1 block
    msgspec.msgpack.encode([1.0, [["BlockRemoved", "abc"]]]),
    msgspec.msgpack.encode([1.0, [], "rank"]),
    msgspec.msgpack.encode({"ts": 1.0}),
])
def test_garbage_raises_event_decode_error(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_random_bytes_never_raise_anything_else():
    import random
    rng = random.Random(5)
    good = encode_batch("array", [STORED, REMOVED])
    for _ in range(2000):
        b = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            decode_batch(bytes(b[:rng.randrange(len(b) + 1)]))
        except EventDecodeError:
            pass


def test_fields_of_later_releases_and_unknown_ones():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "ownership": "t2", "session_id": "s1",
         "lookahead_token_ids": [[3]], "brand_new": 1},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "ownership": "t2"},
        # 0.23's array form: kv_cache_spec_kind and sliding window positional, one more.
        ["BlockStored", [2], None, [1, 2], 2, None, "GPU", None, None, 0, "sliding_window",
         64, "extra"],
    ], 0])
    stored, removed, arr = decode_batch(payload).events
    assert stored.ownership == "t2" and stored.session_id == "s1"
    assert stored.lookahead_token_ids == ((3,),) and stored.unknown_fields == ("brand_new",)
    assert removed.ownership == "t2" and removed.unknown_fields == ()
    assert arr.kv_cache_spec_kind == "sliding_window"
    assert arr.kv_cache_spec_sliding_window == 64 and arr.unknown_fields == ("#12",)
