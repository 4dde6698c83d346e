"""kvcm.Client against a real kvcm-manager process (index-only pools, no agents)."""

from __future__ import annotations

import array
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import List, Optional

import grpc
import pytest

import kvcm
from kvcm import hashing
from conftest import Manager, prompt

NS = kvcm.Namespace("acme", "deepseek-v3")
GPU0 = kvcm.PoolRef("gpu-0", kvcm.Tier.GPU)
GPU1 = kvcm.PoolRef("gpu-1", kvcm.Tier.GPU)
PAGE = 64


def register(client: kvcm.Client, ns: kvcm.Namespace = NS) -> kvcm.RegisterModelResult:
    return client.register_model(ns, kvcm.ModelSpec.deepseek_v3())


def test_every_public_type_is_exported() -> None:
    """A result or spec type added to kvcm.types is `kvcm.<Name>` once it is in that
    module's __all__ (kvcm/__init__.py takes the list from there): this fails if it is not."""
    import enum
    import inspect

    from kvcm import types

    public = {
        name
        for name, value in vars(types).items()
        if not name.startswith("_")
        and inspect.isclass(value)
        and value.__module__ == types.__name__
        and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    }
    assert public <= set(types.__all__), sorted(public - set(types.__all__))
    for name in types.__all__:
        assert getattr(kvcm, name) is getattr(types, name), name
    assert set(types.__all__) <= set(kvcm.__all__)


def test_register_model_caches_the_key_and_reports_bytes(client: kvcm.Client) -> None:
    assert not client.hashes_locally(NS)
    reply = register(client)
    assert reply.created
    assert reply.bytes_per_token == 70272 == kvcm.ModelSpec.deepseek_v3().bytes_per_token()
    assert reply.bytes_per_page == 70272 * PAGE
    assert reply.spec == kvcm.ModelSpec.deepseek_v3()
    assert client.hashes_locally(NS)
    # Idempotent for an equal spec.
    again = register(client)
    assert not again.created and again.key_fingerprint == reply.key_fingerprint
    # A different spec is refused and changes nothing.
    with pytest.raises(kvcm.FailedPrecondition):
        client.register_model(NS, kvcm.ModelSpec.deepseek_v3(kvcm.KvDtype.FP8))
    assert client.stats().namespace(NS).spec == kvcm.ModelSpec.deepseek_v3()


def test_kv_layout_is_one_per_namespace(client: kvcm.Client) -> None:
    cpu = kvcm.ModelSpec.deepseek_v3().with_(kv_layout="vllm-cpu/mla:[block,576]:bf16")
    flash = cpu.with_(kv_layout="flash-mla:[block,576]:bf16")
    # A namespace registered without a layout takes the first one stated.
    assert register(client).spec.kv_layout == ""
    adopted = client.register_model(NS, cpu)
    assert not adopted.created and adopted.spec == cpu
    # Another layout is refused naming both, and changes nothing.
    with pytest.raises(kvcm.FailedPrecondition) as refused:
        client.register_model(NS, flash)
    assert f'kv_layout "{cpu.kv_layout}"; this spec has "{flash.kv_layout}"' in str(refused.value)
    assert client.stats().namespace(NS).spec == cpu
    # A caller that does not know the layout (a router, kvcmctl) is told the stored one.
    assert register(client).spec == cpu
    # A layout is at most 256 bytes of printable ASCII.
    other = kvcm.Namespace("acme", "other")
    for bad in ("x" * 257, "tab\there", "caf\u00e9"):
        with pytest.raises(kvcm.InvalidArgument, match="spec.kv_layout"):
            client.register_model(other, cpu.with_(kv_layout=bad))
    assert client.register_model(other, cpu.with_(kv_layout="~" * 256)).created


def test_catalogue_specs_cost_what_the_manager_says(client: kvcm.Client) -> None:
    for name in kvcm.CATALOG:
        for dtype in (kvcm.KvDtype.BF16, kvcm.KvDtype.FP8, kvcm.KvDtype.INT8):
            spec = kvcm.ModelSpec.from_catalog(name, dtype, page_size_tokens=16)
            reply = client.register_model(kvcm.Namespace("cat", f"{name}-{dtype.name}"), spec)
            assert reply.bytes_per_token == spec.bytes_per_token(), (name, dtype)
            assert reply.bytes_per_page == spec.bytes_per_page(), (name, dtype)
    assert kvcm.ModelSpec.llama3_70b().bytes_per_token() == 327680
    with pytest.raises(KeyError, match="known: deepseek-v3"):
        kvcm.ModelSpec.from_catalog("gpt-5")


def test_insert_match_pages_and_segments(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(300)  # 4 whole pages and a partial one
    ins = client.insert(NS, tokens, GPU0, [10, 11, 12, 13])
    assert (ins.new_pages, ins.already_present_pages, ins.replicated_pages) == (4, 0, 0)
    # A second pool holds the first two pages: pages 0-1 have two replicas, 2-3 one.
    rep = client.insert(NS, tokens[: 2 * PAGE], GPU1, [7, 8])
    assert rep.replicated_pages == 2 and rep.new_pages == 0

    m = client.match(NS, tokens, requester_agent_id="gpu-1")
    assert (m.matched_pages, m.matched_tokens, m.prompt_pages, m.local_pages) == (4, 256, 4, 2)
    assert m.pin_id == 0 and m.lease_expiry is None
    assert [sorted((r.pool.agent_id, r.block_id) for r in page) for page in m.pages] == [
        [("gpu-0", 10), ("gpu-1", 7)],
        [("gpu-0", 11), ("gpu-1", 8)],
        [("gpu-0", 12)],
        [("gpu-0", 13)],
    ]
    assert m.pages[0][0].pool == GPU1  # the requester's replica first
    assert [(s.first_page, s.num_pages) for s in m.segments] == [(0, 2), (2, 2)]
    assert sum(len(s.replicas) for s in m.segments) == 3

    # A longer prompt sharing the prefix matches the same 4 pages; another prompt none.
    assert client.match(NS, tokens + prompt(128, seed=9)).matched_pages == 4
    assert client.match(NS, prompt(300, seed=8)).matched_pages == 0
    # The same prompt as array('i'), bytes and page hashes.
    assert client.match(NS, array.array("i", tokens)).matched_pages == 4
    assert client.match(NS, array.array("i", tokens).tobytes()).matched_pages == 4
    hashes = client.hash_prompt(NS, tokens)
    assert len(hashes) == 4
    assert client.match(NS, page_hashes=hashes).matched_pages == 4
    assert client.match(NS, page_hashes=hashing.encode_page_hashes(hashes[:3])).matched_pages == 3


def test_insert_is_idempotent_and_reports_existing_blocks(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(256)
    client.insert(NS, tokens, GPU0, range(4))
    again = client.insert(NS, tokens, GPU0, [20, 21, 22, 23])
    assert again.already_present_pages == 4 and again.existing_block_ids == [0, 1, 2, 3]
    assert again.new_pages == 0
    hashes = client.hash_prompt(NS, tokens + prompt(64, seed=1))
    longer = client.insert(NS, pool=GPU0, block_ids=range(5), page_hashes=hashes)
    assert longer.already_present_pages == 4 and longer.new_pages == 1


def test_tokens_travel_unhashed_without_register(manager: Manager, client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(200)
    client.insert(NS, tokens, GPU0, range(3))
    with kvcm.Client(manager.address, insecure=True) as other:
        assert not other.hashes_locally(NS)
        assert other.match(NS, tokens).matched_pages == 3  # the manager hashed the tokens
        with pytest.raises(kvcm.FailedPrecondition, match="call register_model"):
            other.match(NS, page_hashes=client.hash_prompt(NS, tokens))
        with pytest.raises(kvcm.FailedPrecondition):
            other.hash_prompt(NS, tokens)


def test_pure_python_hashes_match_what_the_extension_inserted(
    manager: Manager, client: kvcm.Client
) -> None:
    register(client)
    tokens = prompt(300)
    client.insert(NS, tokens, GPU0, range(4))
    script = textwrap.dedent(
        f"""
        import kvcm
        assert kvcm.hashing.BACKEND == "pure", kvcm.hashing.BACKEND
        with kvcm.Client({manager.address!r}, insecure=True) as c:
            c.register_model(kvcm.Namespace("acme", "deepseek-v3"), kvcm.ModelSpec.deepseek_v3())
            print(c.match(kvcm.Namespace("acme", "deepseek-v3"), {tokens!r}).matched_pages)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, KVCM_PURE_PYTHON_HASH="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4"]


def test_match_and_pin_context_manager_releases(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(256)
    client.insert(NS, tokens, GPU0, range(4))
    with client.match_and_pin(NS, tokens, lease_ttl_ms=60000) as prefix:
        assert prefix.pin_id != 0 and prefix.match.matched_pages == 4
        assert prefix.match.lease_expiry is not None
        stats = client.stats()
        assert stats.active_pins == 1
        assert stats.pool(GPU0).pinned_bytes == 4 * 70272 * PAGE
        before = prefix.match.lease_expiry_unix_ms
        time.sleep(0.01)
        after = prefix.renew(120000)
        assert after > before and prefix.match.lease_expiry_unix_ms == after
        # Pinned pages cannot be evicted: all or nothing, nothing changed.
        with pytest.raises(kvcm.ResourceExhausted):
            client.evict_from_pool(GPU0, 1)
        assert client.stats().pool(GPU0).pages == 4
    assert prefix.pin_id == 0
    stats = client.stats()
    assert stats.active_pins == 0 and stats.counters.pins_released == 1
    assert stats.pool(GPU0).pinned_bytes == 0
    with pytest.raises(kvcm.FailedPrecondition, match="holds no pin"):
        prefix.renew()
    prefix.release()  # nothing held: a no-op


def test_context_manager_releases_on_exception(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(128)
    client.insert(NS, tokens, GPU0, range(2))
    with pytest.raises(RuntimeError):
        with client.match_and_pin(NS, tokens):
            assert client.stats().active_pins == 1
            raise RuntimeError("prefill failed")
    assert client.stats().active_pins == 0


def test_no_match_takes_no_pin(client: kvcm.Client) -> None:
    register(client)
    with client.match_and_pin(NS, prompt(128)) as prefix:
        assert prefix.pin_id == 0 and prefix.match.matched_pages == 0
    assert client.stats().active_pins == 0


def test_pin_release_and_renew_errors(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(128)
    client.insert(NS, tokens, GPU0, range(2))
    m = client.match(NS, tokens, pin=True)
    assert m.pin_id != 0
    assert client.renew_lease(NS, m.pin_id, 5000) > 0
    client.release(NS, m.pin_id)
    with pytest.raises(kvcm.NotFound) as e:
        client.release(NS, m.pin_id)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(kvcm.NotFound):
        client.release(NS, 12345)
    with pytest.raises(kvcm.NotFound):
        client.renew_lease(NS, 12345)
    # A lease that lapsed: Aborted.
    short = client.match(NS, tokens, pin=True, lease_ttl_ms=1)
    time.sleep(0.3)
    with pytest.raises(kvcm.Aborted):
        client.renew_lease(NS, short.pin_id)
    assert client.stats().counters.pins_taken == 2


def test_probe_changes_nothing(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(128)
    client.insert(NS, tokens, GPU0, range(2))
    before = client.stats().counters
    assert client.match(NS, tokens, probe=True).matched_pages == 2
    assert client.stats().counters == before
    with pytest.raises(kvcm.InvalidArgument):
        client.match(NS, tokens, probe=True, pin=True)


def test_bad_input_names_the_field_and_changes_nothing(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(256)
    before = client.stats()
    with pytest.raises(kvcm.InvalidArgument, match="block_ids"):
        client.insert(NS, tokens, GPU0, [1, 2, 3])  # 4 pages, 3 blocks
    with pytest.raises(kvcm.InvalidArgument, match="block_ids"):
        client.insert(NS, tokens, GPU0, [1, 1, 2, 3])  # repeated
    with pytest.raises(kvcm.InvalidArgument, match="prompt.page_hashes is empty"):
        client.match(NS, tokens[:10])  # less than a page
    with pytest.raises(kvcm.InvalidArgument, match="lease_ttl_ms"):
        client.match(NS, tokens, pin=True, lease_ttl_ms=10**9)
    with pytest.raises(kvcm.InvalidArgument, match="lease_ttl_ms"):
        client.match(NS, tokens, lease_ttl_ms=-1)  # refused before sending
    with pytest.raises(kvcm.InvalidArgument, match="exactly one of tokens or page_hashes"):
        client.match(NS)
    with pytest.raises(kvcm.InvalidArgument, match="page_hashes: length must be a multiple"):
        client.match(NS, page_hashes=b"x" * 17)
    with pytest.raises(kvcm.InvalidArgument, match=r"page_hashes\[0\]: must be 16 bytes"):
        client.match(NS, page_hashes=[b"short"])
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        client.match(NS, [1, 2**40])
    with pytest.raises(kvcm.InvalidArgument, match="namespace.tenant"):
        client.register_model(kvcm.Namespace("bad tenant!", "m"), kvcm.ModelSpec.llama3_8b())
    with pytest.raises(kvcm.InvalidArgument, match="spec.num_layers"):
        client.register_model(NS, kvcm.ModelSpec.deepseek_v3().with_(num_layers=0))
    after = client.stats()
    assert after.pools == before.pools and after.counters == before.counters
    assert [n.namespace for n in after.namespaces] == [NS]


def test_wrong_scheme_is_refused_and_changes_nothing(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(256)
    client.insert(NS, tokens, GPU0, range(4))
    before = client.stats()
    key = client._keys[NS]  # white box: a client hashing with the wrong page size
    client._keys[NS] = dataclasses.replace(key, page_size_tokens=32)
    with pytest.raises(kvcm.InvalidArgument, match="page_size_tokens 32"):
        client.match(NS, tokens, pin=True)
    with pytest.raises(kvcm.InvalidArgument, match="page_size_tokens 32"):
        client.insert(NS, tokens, GPU1, range(8))
    after = client.stats()
    assert after.counters == before.counters and after.pools == before.pools
    assert after.active_pins == 0


def test_unknown_namespace_is_not_found(client: kvcm.Client) -> None:
    other = kvcm.Namespace("acme", "never-registered")
    with pytest.raises(kvcm.NotFound):
        client.match(other, prompt(64))
    with pytest.raises(kvcm.NotFound):
        client.insert(other, prompt(64), GPU0, [0])
    with pytest.raises(kvcm.NotFound):
        client.delete_namespace(other)
    with pytest.raises(kvcm.NotFound, match="not registered"):
        client.forget_agent("never-registered", force=True)
    with pytest.raises(kvcm.InvalidArgument, match="agent_id"):
        client.forget_agent("")
    assert client.stats().namespaces == []


def test_evict_reserve_and_delete(client: kvcm.Client) -> None:
    register(client)
    page_bytes = 70272 * PAGE
    client.insert(NS, prompt(256), GPU0, range(4))
    client.insert(NS, prompt(256, seed=2), GPU0, range(4, 8))
    with pytest.raises(kvcm.OutOfRange):
        client.evict_from_pool(GPU0, 9 * page_bytes)  # more than the pool holds
    ev = client.evict_from_pool(GPU0, 1)
    assert ev.evicted_pages >= 1 and ev.evicted_bytes >= page_bytes
    left = client.stats().pool(GPU0).pages
    assert left == 8 - ev.evicted_pages
    ev2 = client.evict_from_namespace(NS, page_bytes)
    assert client.stats().pool(GPU0).pages == left - ev2.evicted_pages

    client.insert(NS, prompt(128, seed=4), GPU0, range(8, 10))
    stats = client.stats().pool(GPU0)
    capacity, used = stats.capacity_bytes, stats.used_bytes
    assert used >= 2 * page_bytes
    assert client.reserve(GPU0, capacity) == used  # evicts exactly the shortfall: everything
    assert client.stats().pool(GPU0).reserved_bytes == capacity
    with pytest.raises(kvcm.OutOfRange):
        client.unreserve(GPU0, capacity + 1)
    client.unreserve(GPU0, capacity)
    assert client.stats().pool(GPU0).reserved_bytes == 0

    tokens = prompt(128, seed=3)
    client.insert(NS, tokens, GPU0, range(2))
    pin = client.match(NS, tokens, pin=True).pin_id
    deleted = client.delete_namespace(NS)
    assert deleted.removed_pages == 2 and deleted.dropped_pins == 1
    assert not client.hashes_locally(NS)  # forgotten: no silent re-creation
    with pytest.raises(kvcm.NotFound):
        client.release(NS, pin)
    with pytest.raises(kvcm.NotFound):
        client.match(NS, tokens)
    assert client.stats().namespace(NS) is None


def test_insert_takes_the_tenants_reservation(client: kvcm.Client) -> None:
    register(client)
    page_bytes = 70272 * PAGE
    client.insert(NS, prompt(64, seed=5), GPU0, [9])  # creates the index-only pool
    assert client.reserve(GPU0, 3 * page_bytes, tenant="acme") == 0
    stats = client.stats()
    assert stats.pool(GPU0).reserved_bytes == 3 * page_bytes
    assert next(t for t in stats.tenants if t.tenant == "acme").reserved_bytes == 3 * page_bytes
    client.insert(NS, prompt(128), GPU0, range(2), use_reservation=True)
    assert client.stats().pool(GPU0).reserved_bytes == page_bytes
    client.insert(NS, prompt(128, seed=6), GPU0, range(2, 4))  # not from the reservation
    assert client.stats().pool(GPU0).reserved_bytes == page_bytes
    client.unreserve(GPU0, page_bytes, tenant="acme")
    assert client.stats().pool(GPU0).reserved_bytes == 0


def test_stats_limits_and_tenants(client: kvcm.Client) -> None:
    register(client)
    stats = client.stats()
    assert stats.policy == "select"  # the manager's default
    assert stats.limits.max_tokens_per_request > 0 and stats.limits.default_lease_ttl_ms > 0
    assert [t.tenant for t in stats.tenants] == ["acme"] and stats.tenants[0].namespaces == 1
    ns = stats.namespace(("acme", "deepseek-v3"))
    assert ns is not None and ns.bytes_per_page == 70272 * PAGE and ns.pages == 0


def test_stats_report_the_policy_choice(manager_factory) -> None:
    """The default policy "select": its choice, each candidate's miniature hit rate and its
    sample, after prompts served as a worker would (a match by the pool's agent, then an
    insert). A 64-page pool is simulated whole, so the figures are exact."""
    page_bytes = 70272 * PAGE
    manager = manager_factory(f"--default_pool_capacity_bytes={64 * page_bytes}").start()
    with kvcm.Client(manager.address, insecure=True) as client:
        register(client)
        for _ in range(3):
            for seed in range(4):
                tokens = prompt(4 * PAGE, seed=seed)
                client.match(NS, tokens, requester_agent_id=GPU0.agent_id)
                client.insert(NS, tokens, GPU0, range(4 * seed, 4 * seed + 4))
        stats = client.stats()
    assert stats.policy == "select"
    sel = stats.selection
    # Still on its starting candidate: no pool filled, so no candidate could gain.
    assert sel is not None and sel.active == "conversation" and sel.switches == 0
    assert [c.name for c in sel.candidates] == ["lru", "cost", "adaptive", "density",
                                                "conversation"]
    # The first round's pages missed in every miniature cache, the next two rounds' hit.
    assert all(0.5 < c.shadow_hit_rate <= 1 for c in sel.candidates), sel.candidates
    assert sel.candidate("lru") == sel.candidates[0] and sel.candidate("opt") is None
    # The first match came before the first insert made the pool: no pool's lookup.
    assert (sel.sampled_lookup_pages, sel.sampled_store_pages) == (44, 48)
    assert (sel.pools, sel.min_sample_rate, sel.shadow_pages) == (1, 1.0, 5 * 16)


def test_stats_of_another_policy_have_no_selection(manager_factory) -> None:
    manager = manager_factory("--policy=lru").start()
    with kvcm.Client(manager.address, insecure=True) as client:
        stats = client.stats()
    assert stats.policy == "lru" and stats.selection is None


def test_watch_events_streams_stored_pages(client: kvcm.Client) -> None:
    register(client)
    tokens = prompt(192)
    hashes = client.hash_prompt(NS, tokens)
    events: List[kvcm.CacheEvent] = []
    stream = client.watch_events(NS)

    def read() -> None:
        for event in stream:
            events.append(event)

    def stored() -> Optional[kvcm.CacheEvent]:
        return next((e for e in list(events)
                     if e.kind == kvcm.EventKind.STORED and e.page_hashes == hashes), None)

    def removed_after(first: kvcm.CacheEvent) -> Optional[kvcm.CacheEvent]:
        return next((e for e in list(events)
                     if e.kind == kvcm.EventKind.REMOVED and e.sequence > first.sequence), None)

    reader = threading.Thread(target=read)
    reader.start()
    # The subscription starts asynchronously, and pages stored before it are not stored again
    # by the next insert: until the stream has seen them stored, evict them and insert again.
    deadline = time.monotonic() + 20  # a loaded CI machine subscribes slowly
    while stored() is None and time.monotonic() < deadline:
        client.insert(NS, tokens, GPU0, range(3))
        time.sleep(0.05)
        if stored() is None:
            client.evict_from_namespace(NS, 3)
    first = stored()
    assert first is not None, events
    client.evict_from_namespace(NS, 1)
    while removed_after(first) is None and time.monotonic() < deadline + 20:
        time.sleep(0.02)
    stream.cancel()
    reader.join(5)
    assert not reader.is_alive()
    removed = removed_after(first)
    assert first.pool == GPU0 and first.namespace == NS
    assert removed is not None, events
    assert removed.reason == kvcm.EventReason.EVICTED


def test_retries_until_a_late_manager_starts(manager_factory) -> None:
    manager = manager_factory()
    starter = threading.Timer(0.5, manager.start)
    with kvcm.Client(manager.address, insecure=True, max_attempts=100) as client:
        starter.start()
        t0 = time.monotonic()
        stats = client.stats(deadline_ms=20000)
        assert stats.active_pins == 0 and time.monotonic() - t0 >= 0.4
        c = client.counters
        assert c.calls == 1 and c.retries >= 1 and c.attempts == c.retries + 1
    starter.join()


def test_unavailable_after_max_attempts_and_within_the_deadline(manager_factory) -> None:
    address = manager_factory().address  # never started
    with kvcm.Client(address, insecure=True, max_attempts=3) as client:
        with pytest.raises(kvcm.Unavailable, match=r"\(after 3 attempts\)"):
            client.stats()
        assert client.counters.attempts == 3 and client.counters.retries == 2
    with kvcm.Client(address, insecure=True, max_attempts=100) as client:
        t0 = time.monotonic()
        with pytest.raises(kvcm.KvcmError) as e:
            client.stats(deadline_ms=300)
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 1.5


def test_manager_restart_reregisters_and_retries(manager_factory) -> None:
    manager = manager_factory().start()
    with kvcm.Client(manager.address, insecure=True) as client:
        register(client)
        tokens = prompt(256)
        client.insert(NS, tokens, GPU0, range(4))
        manager.restart()  # same secret: same key; the namespace and index are gone
        # UNAVAILABLE while it restarts (retried), then NOT_FOUND (re-registered, resent).
        ins = client.insert(NS, tokens, GPU0, range(4))
        assert ins.new_pages == 4
        assert client.match(NS, tokens).matched_pages == 4
        assert client.stats().namespace(NS) is not None


def test_stale_key_after_a_secret_change_is_refreshed(manager_factory) -> None:
    manager = manager_factory().start()
    tokens = prompt(256)
    with kvcm.Client(manager.address, insecure=True) as a:
        register(a)
        old = a.hash_prompt(NS, tokens)
        manager.restart(secret_hex="00112233445566778899aabbccddeeff")
        with kvcm.Client(manager.address, insecure=True) as b:
            register(b)  # the namespace now exists under the new secret's key
            b.insert(NS, tokens, GPU0, range(4))
            # a's hashes carry the old fingerprint: FAILED_PRECONDITION on prompt.scheme,
            # so a re-registers and sends again.
            attempts = a.counters.calls
            assert a.match(NS, tokens).matched_pages == 4
            assert a.counters.calls == attempts + 3  # match, register_model, match
            assert a.hash_prompt(NS, tokens) == b.hash_prompt(NS, tokens) != old
            expected_key = hashing.namespace_key(
                bytes.fromhex("00112233445566778899aabbccddeeff"), NS.tenant, NS.model
            )
            assert a._keys[NS].key == expected_key


def test_stale_caller_hashes_are_refused_not_resent(manager_factory) -> None:
    manager = manager_factory().start()
    tokens = prompt(256)
    with kvcm.Client(manager.address, insecure=True) as a:
        register(a)
        stale = a.hash_prompt(NS, tokens)
        manager.restart(secret_hex="ffeeddccbbaa99887766554433221100")
        with kvcm.Client(manager.address, insecure=True) as b:
            register(b)
            b.insert(NS, tokens, GPU0, range(4))
            calls = a.counters.calls
            with pytest.raises(kvcm.FailedPrecondition, match="prompt.scheme.key_fingerprint"):
                a.match(NS, page_hashes=stale)
            assert a.counters.calls == calls + 1  # no re-registration, nothing resent
            # Hashes from tokens are redone with a fresh key.
            assert a.match(NS, tokens).matched_pages == 4
            assert a.match(NS, page_hashes=a.hash_prompt(NS, tokens)).matched_pages == 4


def test_options_are_validated_naming_the_field(tmp_path) -> None:
    cases = {
        "tls_ca_file: is required": dict(),
        "insecure: excludes tls_ca_file": dict(insecure=True, tls_ca_file="ca.pem"),
        "tls_key_file: is required": dict(tls_ca_file="ca.pem", tls_cert_file="c.pem"),
        "max_attempts: must be in 1..100": dict(insecure=True, max_attempts=0),
        "default_deadline_ms: must be > 0": dict(insecure=True, default_deadline_ms=0),
        "max_backoff_ms: must be >= initial_backoff_ms": dict(insecure=True, max_backoff_ms=1),
        "backoff_multiplier: must be >= 1": dict(insecure=True, backoff_multiplier=0.5),
        "token: bearer token must be visible ASCII": dict(insecure=True, token="a b"),
        "give token or token_file, not both": dict(insecure=True, token="t", token_file="f"),
        'tls_ca_file ".*missing.pem": cannot open': dict(tls_ca_file=str(tmp_path / "missing.pem")),
    }
    for message, kwargs in cases.items():
        with pytest.raises(kvcm.InvalidArgument, match=message):
            kvcm.Client("127.0.0.1:1", **kwargs)
    (tmp_path / "notpem").write_text("hello")
    with pytest.raises(kvcm.InvalidArgument, match="holds no PEM certificate"):
        kvcm.Client("127.0.0.1:1", tls_ca_file=str(tmp_path / "notpem"))
    (tmp_path / "tok").write_text("  secret-token-1234567890\n")
    c = kvcm.Client("127.0.0.1:1", insecure=True, token_file=str(tmp_path / "tok"))
    assert c.options.token == "secret-token-1234567890"
    assert "secret" not in repr(c.options)
    c.close()


def test_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_TOKEN", "env-token-abcdefghijkl")
    with kvcm.Client("127.0.0.1:1", insecure=True) as c:
        assert c.options.token == "env-token-abcdefghijkl"
    with kvcm.Client("127.0.0.1:1", insecure=True, token="explicit-token-123456") as c:
        assert c.options.token == "explicit-token-123456"
