"""kvcm's SGLang decoder and mirror on frames SGLang 0.5.23 itself sent: its UnifiedRadixCache
and ZmqEventPublisher, driven by rigs/sglang_publisher.py and captured by
`python -m rigs.sglang_source SGLANG_PYTHON tests/data/sglang/0.5.23.json`."""

import json
from pathlib import Path

import msgspec
import pytest

from kvcm.engines import kinds
from kvcm.engines.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.engines.mirror import EngineMirror, Tier
from kvcm.engines.pagehash import hash_request
from kvcm.engines.wire import parse_live
from kvcm.sglang.events import decode_batch
from kvcm.sglang.pagehash import chain_hashes
from rigs.sglang_source import HeldBlocks

KEY = bytes(range(16))
CAPTURE = json.loads((Path(__file__).parent / "data" / "sglang" / "0.5.23.json").read_text())
PS = CAPTURE["page_size"]


def frames():
    return [[bytes.fromhex(p) for p in f["parts"]] for f in CAPTURE["frames"]]


def test_frames_are_topic_seq_payload_and_events_as_sglang_built_them():
    assert CAPTURE["sglang_version"] == "0.5.23"
    seqs = []
    for f, step in zip(frames(), CAPTURE["steps"]):
        assert f[0] == CAPTURE["topic"].encode()
        seq, payload = parse_live(f)
        seqs.append(seq)
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, rank]
        assert raw[1] == step["events"]
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0
        for ev, built in zip(batch.events, step["events"]):
            assert type(ev).__name__ == built["type"]
            if isinstance(ev, (BlockStored, BlockRemoved)):
                assert list(ev.block_hashes) == built["block_hashes"] and not ev.unknown_fields
    assert seqs == list(range(len(seqs)))


@pytest.mark.parametrize("step", [s for s in CAPTURE["steps"] if s["op"] == "insert"])
def test_published_hashes_are_what_kvcm_recomputes(step):
    stored = [h for e in step["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]]
    chain = chain_hashes(step["tokens"], PS, step.get("salt"))
    assert stored == chain[len(chain) - len(stored):]  # a shared prefix is not stored again


@pytest.mark.parametrize("k", [1, 2])
def test_mirror_equals_what_sglang_holds_after_every_step(k):
    m = EngineMirror(KEY, k * PS, PS, verify_block=kinds.get("sglang").verify_block)
    held, prompts = HeldBlocks(), []
    for f, step in zip(frames(), CAPTURE["steps"]):
        events = decode_batch(parse_live(f)[1]).events
        m.apply_batch(events)
        held.apply(step["events"])
        if any(isinstance(e, AllBlocksCleared) for e in events):
            prompts.clear()
        if step["op"] == "insert":
            prompts.append((step["tokens"], step.get("salt")))
        want = set()
        for tokens, salt in prompts:
            pages = held.leading(chain_hashes(tokens, PS, salt)) // k
            want.update(hash_request(KEY, tokens, k * PS, PS, cache_salt=salt)[:pages])
        assert m.visible_pages(Tier.GPU) == want, step["op"]
    assert not m.counters.refused_blocks and m.orphans == 0
