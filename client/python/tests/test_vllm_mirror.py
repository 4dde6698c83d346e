"""EngineMirror: vLLM block events -> kvcm engine-pool changes."""

import random
import sys

import pytest

from kvcm import hashing
from kvcm.testing.fake_vllm import FakeVllmEngine
from kvcm.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcm.engines.mirror import Change, ChangeKind, EngineMirror, Tier, tier_of_medium
from kvcm.engines.pagehash import hash_request

KEY = bytes(range(16))
BS = 4

STORED, REMOVED, CLEARED = ChangeKind.STORED, ChangeKind.REMOVED, ChangeKind.CLEARED


def toks(n, start=0):
    return tuple(range(start, start + n))


def stored(hashes, parent, tokens, medium="GPU", **kw):
    return BlockStored(tuple(hashes), parent, tuple(tokens), kw.pop("block_size", BS),
                       medium=medium, **kw)


def chain(*hashes):
    return b"".join(hashes)


def test_chain_hashes_like_plain_kvcm_pages():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([11, 12, 13], None, toks(12)))
    plain = hashing.hash_pages(KEY, list(toks(12)), BS)
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*plain))]
    # A continuation names its parent; STORED always carries the chain from page 0.
    m.apply(stored([14], 13, toks(4, 12)))
    plain = hashing.hash_pages(KEY, list(toks(16)), BS)
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*plain))]
    assert m.visible_pages(Tier.GPU) == set(plain)


def test_orphan_waits_for_its_parent():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([2], 1, toks(4, 4)))
    assert m.take_changes() == [] and m.orphans == 1
    m.apply(stored([1], None, toks(4)))
    assert m.take_changes() == [
        Change(STORED, Tier.GPU, chain(*hashing.hash_pages(KEY, list(toks(8)), BS)))]
    assert m.orphans == 0


def test_removing_a_parent_hides_children_until_it_comes_back():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1, 2, 3], None, toks(12)))
    h = hashing.hash_pages(KEY, list(toks(12)), BS)
    m.take_changes()
    m.apply(BlockRemoved((2,), "GPU"))
    # The manager drops page 1 and everything under it; page 0 stays.
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(h[0], h[1]))]
    assert m.visible_pages(Tier.GPU) == {h[0]}
    m.apply(stored([2], 1, toks(4, 4)))  # re-stored: the held child 3 is reachable again
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*h))]
    m.apply(BlockRemoved((1,), "GPU"))
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(h[0]))]
    assert m.visible_pages(Tier.GPU) == set()


def test_restore_of_a_held_block_is_not_a_copy():
    # vLLM >= 0.26 kv_cache_report_mode="full" re-sends BlockStored for reused blocks.
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1, 2], None, toks(8)))
    m.apply(stored([1, 2], None, toks(8)))
    assert len(m.take_changes()) == 1 and m.counters.restored_blocks == 2
    m.apply(BlockRemoved((2,), "GPU"))  # the one physical block left: so did the page
    h = hashing.hash_pages(KEY, list(toks(8)), BS)
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(*h))]
    m.apply(BlockRemoved((2,), "GPU"))
    assert m.counters.unknown_removals == 1
    # remaining_copy_counts, where a release sends it, is authoritative.
    m.apply(stored([3], None, toks(4, 50)))
    m.take_changes()
    m.apply(BlockRemoved((3,), "GPU", remaining_copy_counts=(1,)))
    assert m.take_changes() == []
    m.apply(BlockRemoved((3,), "GPU", remaining_copy_counts=(0,)))
    assert [c.kind for c in m.take_changes()] == [REMOVED]


def test_vllm_blocks_sharing_a_page_do_not_remove_each_other():
    # Two vLLM chains kvcm hashes alike (a salt a 0.9 release does not publish): the page
    # stays while either holds it.
    m = EngineMirror(KEY, BS, BS)
    m.apply_batch([stored([1, 3], None, toks(8)), stored([2, 4], None, toks(4) + toks(4, 90))])
    assert m.counters.shared_pages == 1
    a = hashing.hash_pages(KEY, list(toks(8)), BS)
    b = hashing.hash_pages(KEY, list(toks(4) + toks(4, 90)), BS)
    m.take_changes()
    m.apply(BlockRemoved((1,), "GPU"))  # page 0 still held by 2; a[1] under 1 leaves
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(*a))]
    assert m.visible_pages(Tier.GPU) == set(b)
    m.apply(BlockRemoved((2,), "GPU"))
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(b[0]))]
    assert m.visible_pages(Tier.GPU) == set()


def test_lookahead_blocks_are_refused():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1, 2], None, toks(8), lookahead_token_ids=((8,), (9,))))
    assert m.take_changes() == [] and m.counters.refused_blocks == {"lookahead": 2}
    m.apply(stored([3], None, toks(4), lookahead_token_ids=((),)))  # nothing beyond
    assert len(m.take_changes()) == 1


def test_lora_blocks_refused_unless_keyed_by_name():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1], None, toks(4), lora_name="x", extra_keys=(("x",),)))
    m.apply(stored([2], None, toks(4, 4), lora_id=3))
    assert m.take_changes() == [] and m.counters.refused_blocks == {"lora": 2}
    m = EngineMirror(KEY, BS, BS, lora_by_name=True)
    m.apply(stored([1], None, toks(4), lora_name="x", extra_keys=(("x",),)))
    assert len(m.take_changes()) == 1


def test_fields_that_change_nothing_are_counted():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1], None, toks(4), ownership="tier2", session_id="s",
                   kv_cache_spec_kind="full_attention", unknown_fields=("new",)))
    m.apply(BlockRemoved((1,), "GPU", ownership="tier2", unknown_fields=("#4",)))
    assert m.counters.ignored_fields == {"ownership": 2, "session_id": 1,
                                         "kv_cache_spec_kind": 1}
    assert m.counters.unknown_fields == {"new": 1, "#4": 1}


def test_pages_of_four_blocks():
    ps = 4 * BS
    m = EngineMirror(KEY, ps, BS)
    m.apply(stored(range(1, 8), None, toks(7 * BS)))  # one whole page and 3 blocks
    h = hash_request(KEY, toks(8 * BS), ps, BS)
    assert h == hashing.hash_pages(KEY, list(toks(8 * BS)), ps)
    assert m.take_changes() == [Change(STORED, Tier.GPU, h[0])]
    m.apply(stored([8], 7, toks(BS, 7 * BS)))
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*h))]
    m.apply(BlockRemoved((6,), "GPU"))  # any block of page 1 takes page 1 away
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(*h))]
    m.apply(BlockRemoved((3,), "GPU"))
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, h[0])]
    m.apply(stored([3], 2, toks(BS, 2 * BS)))
    m.apply(stored([6], 5, toks(BS, 5 * BS)))
    assert [c.page_hashes for c in m.take_changes()] == [h[0], chain(*h)]


def test_page_size_not_a_multiple_of_block_size_is_refused():
    with pytest.raises(ValueError, match=r"page size 24 .* block size 16"):
        EngineMirror(KEY, 24, 16)
    with pytest.raises(ValueError, match="block size 32"):
        EngineMirror(KEY, 16, 32)


def test_event_with_another_block_size_is_refused():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1, 2], None, toks(16), block_size=8))
    m.apply(stored([3], None, toks(5)))  # tokens do not fill the blocks
    assert m.take_changes() == [] and m.known_blocks == 0
    assert m.counters.refused_blocks == {"block_size": 2, "token_count": 1}


@pytest.mark.parametrize("k", [1, 2])
def test_extra_keys_separate_salts_and_loras(k):
    ps = k * BS
    tokens = toks(4 * BS)
    cases = {
        "plain": dict(),
        "salt-a": dict(cache_salt="a"),
        "salt-b": dict(cache_salt="b"),
        "lora-x": dict(lora_name="x"),
        "lora-y": dict(lora_name="y"),
        "lora-x-salt-a": dict(lora_name="x", cache_salt="a"),
    }
    seen = {}
    for name, kw in cases.items():
        eng = FakeVllmEngine(BS, 64, form="map")
        eng.process(list(tokens) + [0], **kw)
        m = EngineMirror(KEY, ps, BS, lora_by_name=True)
        for e in eng.events:
            m.apply(e)
        (change,) = m.take_changes()
        got = [change.page_hashes[i:i + 16] for i in range(0, len(change.page_hashes), 16)]
        # The bridge's hashes are what a router computes for the same request.
        assert got == hash_request(KEY, tokens, ps, BS, **kw), name
        seen[name] = got
    assert seen["plain"] == hashing.hash_pages(KEY, list(tokens), ps)
    names = list(seen)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            # Not one page in common: the salt is on page 0 and every page chains from it.
            assert not set(seen[a]) & set(seen[b]), (a, b)


def test_legacy_lora_id_is_keyed():
    eng = FakeVllmEngine(BS, 64, form="legacy")
    eng.process(list(toks(8)) + [0], lora_id=7)
    eng.process(list(toks(8)) + [0])
    m = EngineMirror(KEY, BS, BS, lora_by_name=True)
    legacy = [BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                          lora_id=e.lora_id) for e in eng.events]  # no medium, no extra_keys
    for e in legacy:
        m.apply(e)
    lora, plain = m.take_changes()
    assert lora.page_hashes == chain(*hash_request(KEY, toks(8), BS, BS, lora_id=7))
    assert plain.page_hashes == chain(*hashing.hash_pages(KEY, list(toks(8)), BS))


def test_tiers_and_content_less_offload_events():
    assert tier_of_medium(None) == tier_of_medium("GPU") == Tier.GPU
    assert tier_of_medium("CPU") == Tier.HOST
    assert tier_of_medium("local_disk") == tier_of_medium("NVMe") == Tier.DISK
    assert tier_of_medium("STORAGE") == Tier.DISK
    assert tier_of_medium("carrier pigeon") is None
    m = EngineMirror(KEY, BS, BS)
    h = hashing.hash_pages(KEY, list(toks(8)), BS)
    m.apply(stored([1, 2], None, toks(8)))
    # vLLM's offloading connector sends no tokens: the content comes from the GPU event.
    m.apply(BlockStored((1, 2), None, (), 0, medium="CPU"))
    m.apply(BlockStored((1,), None, (), 0, medium="DISK"))
    m.apply(BlockStored((9,), None, (), 0, medium="CPU"))  # never seen: an orphan
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*h)),
                                Change(STORED, Tier.HOST, chain(*h)),
                                Change(STORED, Tier.DISK, h[0])]
    assert m.orphans == 1
    m.apply(BlockRemoved((1, 2), "GPU"))  # the HOST copy keeps the content
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, h[0])]
    assert m.visible_pages(Tier.HOST) == set(h)
    m.apply(stored([5], None, toks(4), medium="tape"))
    assert m.counters.refused_blocks["unknown_medium"] == 1


def test_clear_group_filter_and_remote_locality():
    m = EngineMirror(KEY, BS, BS, kv_group=0)
    m.apply(stored([1], None, toks(4), group_idx=1))
    m.apply(stored([1], None, toks(4), locality="REMOTE"))
    assert m.take_changes() == [] and m.known_blocks == 0
    m.apply(stored([1], None, toks(4), group_idx=0))
    m.apply(BlockStored((1,), None, (), 0, medium="CPU"))
    m.take_changes()
    m.apply(AllBlocksCleared())
    assert m.take_changes() == [Change(CLEARED, Tier.GPU), Change(CLEARED, Tier.HOST)]
    assert m.known_blocks == 0 and m.visible_pages(Tier.GPU) == set()
    assert m.counters.ignored_events == {"other_group": 1, "remote": 1}


def test_rekey_rehashes_everything():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1, 2], None, toks(8), extra_keys=(("s",), None)))
    m.take_changes()
    new_key = bytes(16)
    m.rekey(new_key)
    assert m.take_changes() == []
    assert m.snapshot() == [
        Change(STORED, Tier.GPU, chain(*hash_request(new_key, toks(8), BS, BS,
                                                     cache_salt="s")))]


def test_deep_chain_needs_no_recursion():
    n = 3 * sys.getrecursionlimit()
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored(range(1, n + 1), None, [7] * (n * BS)))
    (c,) = m.take_changes()
    assert c.num_pages == n
    m.apply(BlockRemoved((1,), "GPU"))
    assert m.take_changes()[0].num_pages == 1
    m.apply(stored([1], None, [7] * BS))
    assert m.take_changes()[0].num_pages == n


class PoolModel:
    """What the manager makes of a change stream: a set of chains per tier."""

    def __init__(self):
        self.parent = {}
        self.pages = {t: set() for t in Tier}

    def apply(self, c):
        pages = self.pages[c.tier]
        hs = [c.page_hashes[i:i + 16] for i in range(0, len(c.page_hashes), 16)]
        if c.kind == CLEARED:
            pages.clear()
        elif c.kind == STORED:
            for i, h in enumerate(hs):
                self.parent[h] = hs[i - 1] if i else None
                pages.add(h)
        else:
            assert hs[-1] in pages, "REMOVED of a page the pool does not hold"
            gone = {hs[-1]}
            changed = True
            while changed:
                more = {h for h in pages if self.parent.get(h) in gone} - gone
                changed = bool(more)
                gone |= more
            pages -= gone


def expected_visible(eng, key, k):
    """kvcm hashes of every page the engine holds with all its ancestors, from its own state."""
    cached, out = eng.cached_digests(), set()
    for d in cached:
        path = []
        x = d
        while x is not None:
            path.append(x)
            x = eng.meta[x][0]
        path.reverse()
        if len(path) % k or not all(p in cached for p in path):
            continue
        tokens = [t for p in path for t in eng.meta[p][1]]
        extras = [eng.meta[p][2] for p in path]
        out.add(hash_request(key, tokens, k * eng.block_size, eng.block_size,
                             block_extras=extras)[-1])
    return out


@pytest.mark.parametrize("form, batched, report", [("array", False, "incremental"),
                                                   ("map", True, "incremental"),
                                                   ("map", True, "full")])
@pytest.mark.parametrize("k", [1, 3])
def test_random_workload_matches_the_engine(form, batched, report, k):
    rng = random.Random(k * 7 + len(form))
    eng = FakeVllmEngine(BS, 48, form=form, cpu_blocks=20, report_mode=report)
    m = EngineMirror(KEY, k * BS, BS, lora_by_name=True)
    pool = PoolModel()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    applied = 0
    for step in range(400):
        p = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        if len(p) % BS == 0:
            # A block-aligned prompt recomputes its cached last block: a second physical
            # copy, which the mirror takes for a re-report (test_restore_...).
            p.append(0)
        kw = rng.choice([{}, {}, {"cache_salt": "s1"}, {"lora_name": "L"}])
        eng.process(p, **kw)
        if step == 250:
            eng.clear()
        for b in eng.batches[applied:]:
            if batched:
                m.apply_batch(b)
            else:
                for e in b:
                    m.apply(e)
        applied = len(eng.batches)
        for c in m.take_changes():
            pool.apply(c)
        if step % 25 == 0 or step == 399:
            want = expected_visible(eng, KEY, k)
            assert m.visible_pages(Tier.GPU) == want
            assert pool.pages[Tier.GPU] == want
            assert pool.pages[Tier.HOST] == m.visible_pages(Tier.HOST)
            snap = PoolModel()
            for c in m.snapshot():
                snap.apply(c)
            assert snap.pages == pool.pages
    assert m.counters.refused_blocks == {}
    assert (m.counters.restored_blocks > 0) == (report == "full")


def test_extra_keys_kvcm_cannot_encode_are_refused():
    m = EngineMirror(KEY, BS, BS)
    m.apply(stored([1], None, toks(4), extra_keys=((float("nan"),),)))
    m.apply(stored([2], None, toks(4), extra_keys=((1 << 200,),)))
    assert m.take_changes() == [] and m.known_blocks == 0
    assert m.counters.refused_blocks == {"extra_keys": 2}


def test_a_batch_gives_one_change_per_chain():
    m = EngineMirror(KEY, BS, BS)
    h = hashing.hash_pages(KEY, list(toks(20)), BS)
    # vLLM stores a prompt's blocks over several events of one step.
    m.apply_batch([stored([1, 2], None, toks(8)), stored([3], 2, toks(4, 8)),
                   stored([4, 5], 3, toks(8, 12))])
    assert m.take_changes() == [Change(STORED, Tier.GPU, chain(*h))]
    # ... and evicts tail first, one event per block.
    m.apply_batch([BlockRemoved((b,), "GPU") for b in (5, 4, 3)])
    assert m.take_changes() == [Change(REMOVED, Tier.GPU, chain(*h[:3]))]
    # Evicted and stored again within one step: nothing changed.
    m.apply_batch([BlockRemoved((2,), "GPU"), stored([2], 1, toks(4, 4))])
    assert m.take_changes() == [] and m.visible_pages(Tier.GPU) == set(h[:2])


def test_releases_without_extra_keys_are_counted_or_refused():
    from kvcm.testing.fake_vllm import encode_batch
    from kvcm.vllm.events import decode_batch
    # vLLM 0.14's array: no extra_keys field, so a salted block looks plain.
    old = decode_batch(encode_batch("array", [stored([1], None, toks(4))],
                                    array_fields=(7, 2))).events[0]
    new = decode_batch(encode_batch("array", [stored([2], None, toks(4, 4))])).events[0]
    assert not old.keys_published and new.keys_published
    m = EngineMirror(KEY, BS, BS)
    m.apply_batch([old, new])
    assert len(m.take_changes()) == 2 and m.counters.unkeyed_blocks == 1
    m = EngineMirror(KEY, BS, BS, require_extra_keys=True)
    m.apply_batch([old, new])
    assert len(m.take_changes()) == 1 and m.counters.refused_blocks == {"no_extra_keys": 1}
