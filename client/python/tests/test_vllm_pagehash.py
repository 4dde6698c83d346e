"""Engine extra keys in kvcm page hashes: the byte layout of docs/HASHING.md and its vectors."""

import struct

import pytest

from kvcm import hashing
from kvcm.engines.pagehash import (blocks_per_page, canonical_extras, hash_request, mixed_prev,
                                request_block_extras)

KEY = bytes(range(16))


def le32(n):
    return struct.pack("<I", n)


def test_canonical_bytes_by_hand():
    # [("s",)]: a list of one block, whose extras are a list of one string.
    assert canonical_extras([("s",)]) == (b"\x07" + le32(1) + b"\x07" + le32(1) + b"\x05"
                                          + le32(1) + b"s")
    # None per block without keys; ints are 16-byte two's complement; bytes; bools; floats.
    assert canonical_extras([None, (-1, b"\x01", True, 1.5)]) == (
        b"\x07" + le32(2) + b"\x00" + b"\x07" + le32(4) + b"\x03" + b"\xff" * 16
        + b"\x06" + le32(1) + b"\x01" + b"\x02" + b"\x04" + struct.pack("<d", 1.5))
    # An empty tuple is no extra keys.
    assert canonical_extras([()]) == canonical_extras([None])


def test_vectors_of_hashing_md():
    assert canonical_extras([("lora-a", ("mm-1", 3), "s"), None]).hex() == (
        "0702000000070300000005060000006c6f72612d61070200000005040000006d6d2d31030300000000"
        "000000000000000000000005010000007300")
    toks = list(range(32))
    assert [h.hex() for h in hash_request(KEY, toks, 16, 16)] == [
        "d82343566bad4263d943ea947364fd33", "d5d9af420683b84896bfd6d2b09557d4"]
    assert [h.hex() for h in hash_request(KEY, toks, 16, 16, cache_salt="s")] == [
        "0cf142f4cc33d3b03744f674ec8eb1a3", "c6a53039d160e14d1a0491175ca2eec6"]
    assert [h.hex() for h in hash_request(KEY, toks, 32, 16, lora_name="lora-a",
                                          cache_salt="s")] == [
        "96bf15236c699a02526eb8b545634ac7"]


def test_construction_from_the_primitives():
    toks = list(range(32))
    prev = hashing.siphash128(KEY, b"kvcm/extra/v1" + hashing.ZERO_HASH
                              + canonical_extras([("s",)]))
    p0 = hashing.hash_page(KEY, prev, toks[:16])
    p1 = hashing.hash_page(KEY, p0, toks[16:])  # no extra keys on block 1: a plain page
    assert hash_request(KEY, toks, 16, 16, cache_salt="s") == [p0, p1]
    assert hash_request(KEY, toks, 16, 16) == hashing.hash_pages(KEY, toks, 16)
    assert mixed_prev(KEY, p0, [None, None]) == p0


def test_request_block_extras_follow_vllm():
    assert request_block_extras(3) == [None, None, None]
    assert request_block_extras(2, cache_salt="s") == [("s",), None]
    assert request_block_extras(2, cache_salt="") == [None, None]  # vLLM: a falsy salt is none
    assert request_block_extras(2, lora_name="L", cache_salt="s") == [("L", "s"), ("L",)]
    assert request_block_extras(2, lora_id=4) == [(4,), (4,)]


def test_sizes():
    assert blocks_per_page(64, 16) == 4
    with pytest.raises(ValueError, match="page size 48 tokens .* block size 32 tokens"):
        blocks_per_page(48, 32)
    with pytest.raises(ValueError, match="block_extras has 1 entries for 2 blocks"):
        hash_request(KEY, list(range(32)), 16, 16, block_extras=[None])
    assert hash_request(KEY, list(range(31)), 16, 16) == hash_request(KEY, list(range(16)),
                                                                      16, 16)


def test_unencodable_extra_keys_are_refused():
    with pytest.raises(ValueError):
        canonical_extras([({"a": 1},)])
    with pytest.raises(ValueError):
        canonical_extras([(float("nan"),)])
    with pytest.raises(ValueError):
        canonical_extras([(1 << 127,)])
