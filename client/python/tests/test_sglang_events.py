"""kvcm.sglang: SGLang 0.5.23's KV-event batches decoded, its block hashes recomputed, and the
mirror fed from them; bad input refused and counted. The events are built the way SGLang's
KVCacheEventRecorder and ZmqEventPublisher build them (docs/ENGINES.md, "SGLang's wire
format"); test_sglang_capture.py checks the same against frames SGLang itself sent."""

import msgspec
import pytest

from kvcm.engines import kinds
from kvcm.engines.config import ConfigError, EngineConfig
from kvcm.engines.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError
from kvcm.engines.mirror import EngineMirror, Tier
from kvcm.engines.pagehash import hash_request
from kvcm.sglang.events import decode_batch
from kvcm.sglang.pagehash import (chain_hashes, namespace_seed, page_digest, published_hash,
                                  salt_digest)

KEY = bytes(range(16))
PS = 4  # SGLang's --page-size: one block


def toks(n, start=0):
    return list(range(start, start + n))


def stored(tokens, parent=None, salt=None, dynamo=False, **kw):
    """A BlockStored map of whole pages, hashed as SGLang hashes them."""
    hashes = kw.pop("hashes", None)
    if hashes is None:
        hashes = chain_hashes(tokens, PS, salt, dynamo) if parent is None else kw.pop("h")
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
          "token_ids": tokens, "block_size": PS, "lora_id": None, "medium": "GPU"}
    if salt is not None:
        ev["cache_salt"] = salt
    ev.update(kw)
    return ev


def payload(*events, rank=0, ts=1.5):
    return msgspec.msgpack.encode([ts, list(events), rank])


def mirror(page_size=PS):
    return EngineMirror(KEY, page_size, PS, verify_block=kinds.get("sglang").verify_block)


def visible(m):
    return m.visible_pages(Tier.GPU)


def test_batch_decodes_like_sglang_sends_it():
    b = decode_batch(payload(stored(toks(8)), {"type": "BlockRemoved", "block_hashes": [5]},
                             {"type": "AllBlocksCleared"}, rank=3))
    assert b.ts == 1.5 and b.data_parallel_rank == 3
    s, r, c = b.events
    assert isinstance(s, BlockStored) and s.block_hashes == tuple(chain_hashes(toks(8), PS))
    assert s.token_ids == tuple(toks(8)) and s.extra_keys == (None, None)
    assert r == BlockRemoved((5,)) and c == AllBlocksCleared()


def test_page_hash_is_sha256_chain_truncated_to_signed_int64():
    import hashlib
    import struct
    d0 = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert page_digest(None, [1, 2, 3, 4]) == d0
    assert chain_hashes(toks(8, 1), PS) == [int.from_bytes(d[:8], "big", signed=True)
                                            for d in (d0, d1)]
    wide = hashlib.sha256(b"\xff" + struct.pack("<2Q", 1 << 33, 1)).digest()
    assert page_digest(None, [1 << 33, 1]) == wide


def test_mirror_publishes_kvcm_pages_of_sglang_blocks():
    m = mirror(page_size=2 * PS)
    m.apply_batch(decode_batch(payload(stored(toks(16)))).events)
    assert visible(m) == set(hash_request(KEY, toks(16), 2 * PS, PS))
    h = chain_hashes(toks(24), PS)
    m.apply_batch(decode_batch(payload(stored(toks(8, 16), parent=h[3], h=h[4:]))).events)
    assert visible(m) == set(hash_request(KEY, toks(24), 2 * PS, PS))
    assert not m.counters.refused_blocks and m.orphans == 0


def test_salt_chains_from_the_salt_and_keys_the_first_block():
    m = mirror()
    m.apply_batch(decode_batch(payload(stored(toks(8), salt="s1"))).events)
    assert visible(m) == set(hash_request(KEY, toks(8), PS, PS, cache_salt="s1"))
    assert not visible(m) & set(hash_request(KEY, toks(8), PS, PS))
    assert not m.counters.refused_blocks


def test_dynamo_format_namespaced_hashes_verify():
    m = mirror()
    m.apply_batch(decode_batch(payload(stored(toks(8), salt="s1", dynamo=True))).events)
    assert visible(m) == set(hash_request(KEY, toks(8), PS, PS, cache_salt="s1"))
    seed = namespace_seed(None, "s1")
    assert chain_hashes(toks(4), PS, "s1", dynamo=True) == [
        published_hash(page_digest(salt_digest("s1"), toks(4)), seed)]


def test_hash_taking_in_what_events_do_not_carry_is_refused_with_its_subtree():
    m = mirror()
    good = chain_hashes(toks(8), PS)
    # As SGLang's "dynamo" format hashes a request with an extra_key: not recomputable.
    bad = [published_hash(page_digest(None, toks(4)), namespace_seed("tenant-x", None))]
    m.apply_batch(decode_batch(payload(stored(toks(4), hashes=bad),
                                       stored(toks(4, 4), parent=bad[0], h=[good[1]]))).events)
    assert visible(m) == set()
    # Both stay orphans: kept (a later BlockRemoved finds them), never published.
    assert m.counters.refused_blocks == {"hash_mismatch": 1} and m.orphans == 2


@pytest.mark.parametrize("change,reason", [
    ({"block_size": 3, "token_ids": toks(3)}, "block_size"),
    ({"token_ids": toks(7)}, "token_count"),
    ({"lora_name": "adapter-1"}, "lora"),
    ({"medium": "EXTERNAL"}, "unknown_medium"),
    ({"token_ids": [[t, t + 1] for t in toks(8)]}, "bigram"),
    ({"token_ids": [1 << 33] + toks(7)}, "token_range"),
])
def test_blocks_kvcm_cannot_mirror_are_refused_and_counted(change, reason):
    m = mirror()
    ev = stored(toks(8))
    ev.update(change)
    m.apply_batch(decode_batch(payload(ev)).events)
    assert visible(m) == set() and m.known_blocks == 0
    assert m.counters.refused_blocks == {reason: 2}


def test_unknown_fields_are_counted_and_the_event_applies():
    m = mirror()
    m.apply_batch(decode_batch(payload(stored(toks(4), future_field=7, session_id="s"))).events)
    assert m.counters.unknown_fields == {"future_field": 1}
    assert m.counters.ignored_fields == {"session_id": 1}
    assert visible(m) == set(hash_request(KEY, toks(4), PS, PS))


def test_host_tier_and_removal():
    m = mirror()
    ev = stored(toks(8))
    m.apply_batch(decode_batch(payload(ev, dict(ev, medium="CPU_PINNED"))).events)
    assert m.visible_pages(Tier.HOST) == visible(m) != set()
    m.apply_batch(decode_batch(payload({"type": "BlockRemoved", "block_hashes":
                                        ev["block_hashes"][1:], "medium": "GPU"})).events)
    assert visible(m) == {hash_request(KEY, toks(8), PS, PS)[0]}
    assert len(m.visible_pages(Tier.HOST)) == 2


@pytest.mark.parametrize("raw", [
    b"\xc1not msgpack",
    msgspec.msgpack.encode({"nope": 1}),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None]], 0]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}], 0]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"],
                                   "token_ids": [], "block_size": 4}], 0]),
    msgspec.msgpack.encode([float("nan"), [], 0]),
])
def test_garbage_raises_event_decode_error_only(raw):
    with pytest.raises(EventDecodeError):
        decode_batch(raw)


def test_engine_kinds_by_name():
    assert kinds.get("sglang").name == "sglang" and kinds.get("vllm").verify_block is None
    assert set(kinds.names()) >= {"vllm", "sglang"}
    with pytest.raises(KeyError, match="unknown engine kind"):
        kinds.get("trtllm")
    EngineConfig(id="s", endpoint="tcp://h:1", kind="sglang").validate()
    with pytest.raises(ConfigError, match="kind"):
        EngineConfig(id="s", endpoint="tcp://h:1", kind="trtllm").validate()
