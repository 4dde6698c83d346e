"""Runs in SGLang's environment (scripts/sglang_env.sh), driven by test_sglang_hicache.py:
SGLang's own storage-backend factory, host KV pools, HiCacheController storage paths, page
keys and failure injector, with kvcm.sglang.hicache.KvcmHiCacheStorage behind them and a
real kvcm-manager and kvcm-agents (host pools) that the test started.

    python sglang_hicache_driver.py CONFIG_JSON OUT_JSON

Each scenario's outcome goes to OUT_JSON as {name: {"ok": bool, "error": str, ...}}; the
pytest side asserts on them (one test each) and on the manager's and agents' state.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import traceback
import types
import warnings
from typing import Any, Callable, Dict, List

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import (  # noqa: E402
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageFailureInjector,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

import kvcm  # noqa: E402
from kvcm.sglang.hicache import KvcmHiCacheStorage  # noqa: E402

CFG: Dict[str, Any] = json.loads(open(sys.argv[1]).read())
PAGE = CFG["page_size"]  # tokens per page, the agents' --page_size_tokens
RESULTS: Dict[str, Dict[str, Any]] = {}


def scenario(fn: Callable[[Dict[str, Any]], None]) -> Callable:
    out: Dict[str, Any] = {"ok": False, "error": ""}
    RESULTS[fn.__name__] = out
    try:
        fn(out)
        out["ok"] = True
    except Exception:  # noqa: BLE001 - reported to pytest
        out["error"] = traceback.format_exc()
    return fn


def mha_host_pool(layout: str = "page_first") -> MHATokenToKVPoolHost:
    """SGLang's own device (CPU) and host KV pools, in the agents' MHA geometry."""
    g = CFG["mha"]
    device = MHATokenToKVPool(256, PAGE, torch.bfloat16, g["heads"], g["head_dim"],
                              g["layers"], "cpu", False)
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer)


def mla_host_pool() -> MLATokenToKVPoolHost:
    g = CFG["mla"]
    device = MLATokenToKVPool(256, PAGE, torch.bfloat16, g["kv_lora_rank"], g["rope_dim"],
                              g["layers"], "cpu", False)
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
        pin_memory=False, device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer, target_layer_num=g["layers"])


def storage_config(agent: str, *, tenant: str = None, mla: bool = False,
                   **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=CFG["model"],
        extra_config={"backend_name": "kvcm", "module_path": "kvcm.sglang.hicache",
                      "class_name": "KvcmHiCacheStorage",
                      "manager_address": CFG["manager"], "agent_id": agent,
                      "agent_address": CFG["agents"].get(agent, ""),
                      "tenant": tenant or CFG["tenant"], **extra})


def secure_config(agent: str, who: Any, **extra: Any) -> HiCacheStorageConfig:
    """storage_config for an agent of the secured cluster (mutual TLS, tokens) with the
    token file of `who` (None: no token_file)."""
    sec = CFG["secure"]
    tls = {k: sec[k] for k in ("tls_ca_file", "tls_cert_file", "tls_key_file")}
    if who is not None:
        tls["token_file"] = sec["tokens"][who]
    return storage_config(agent, manager_address=sec["manager"],
                          agent_address=sec["agents"][agent], **tls, **extra)


def attach(agent: str, pool: Any, config: Any = None, **kw: Any) -> Any:
    """As HiCacheController.attach_storage_backend: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", config or storage_config(agent, **kw), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def controller(backend: Any, pool: Any, *, zero_copy: bool = False) -> Any:
    """The fields of a HiCacheController that its storage paths read (no GPU, no threads)."""
    c = types.SimpleNamespace(storage_backend=backend, storage_host_pool=pool,
                              mem_pool_host=pool, page_size=PAGE,
                              prefetch_sync_queue=queue.Queue())
    get = HiCacheController._page_get_zero_copy if zero_copy else \
        HiCacheController._generic_page_get
    put = HiCacheController._page_set_zero_copy if zero_copy else \
        HiCacheController._generic_page_set
    c.page_get_func = lambda *a, **k: get(c, *a, **k)
    c.page_set_func = lambda *a, **k: put(c, *a, **k)
    c._page_transfer_kv_batch = lambda *a: HiCacheController._page_transfer_kv_batch(c, *a)
    return c


def tokens(seed: int, pages: int) -> List[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(pages * PAGE)]


def fill(pool: Any, n_pages: int) -> torch.Tensor:
    """Host indices of n_pages fresh pages, filled with random bytes."""
    indices = pool.alloc(n_pages * PAGE)
    for i in range(n_pages):
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).copy_(torch.randint(0, 256, (page.numel() * page.element_size(),),
                                                   dtype=torch.uint8))
        pool.set_from_flat_data_page(indices[i * PAGE], page)
    return indices


def page_bytes(pool: Any, indices: torch.Tensor, i: int) -> bytes:
    return pool.get_data_page(indices[i * PAGE], flat=True).view(torch.uint8).numpy().tobytes()


def backup(c: Any, indices: torch.Tensor, toks: List[int]) -> int:
    """HiCacheController._page_backup of a root node's pages; returns tokens stored."""
    keys = get_storage_hash_str(toks, None, page_size=PAGE)
    op = StorageOperation(indices, toks, hash_value=keys)
    HiCacheController._page_backup(c, op)
    return op.completed_tokens


def prefetch(c: Any, pool: Any, toks: List[int]) -> tuple:
    """HiCacheController's prefetch: the storage hit query, then the page transfer into
    fresh host pages; returns (hit tokens, pages transferred, host indices)."""
    op = PrefetchOperation("req", toks)
    keys, hit_tokens = HiCacheController._storage_hit_query(c, op)
    op.hash_value = keys
    op.host_indices = pool.alloc(max(len(keys), 1) * PAGE)
    done = HiCacheController._page_transfer(c, op) if keys else 0
    return hit_tokens, done, op.host_indices


# ---- scenarios ------------------------------------------------------------------------


@scenario
def factory_round_trip(out: Dict[str, Any]) -> None:
    """Engine A stores a prompt's pages into agent A; engine B (agent B) prefetches them
    through the manager's index, byte for byte, and then holds them locally."""
    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    a, b = attach("a", pool_a), attach("b", pool_b)
    assert isinstance(a, KvcmHiCacheStorage), type(a)
    n = 5
    toks = tokens(1, n)
    src = fill(pool_a, n)
    assert backup(controller(a, pool_a), src, toks) == n * PAGE
    assert a.counters["stored_pages"] == n, a.counters
    hit, done, dst = prefetch(controller(b, pool_b), pool_b, toks)
    assert (hit, done) == (n * PAGE, n), (hit, done, b.counters)
    for i in range(n):
        assert page_bytes(pool_b, dst, i) == page_bytes(pool_a, src, i), f"page {i} differs"
    assert b.counters["fetched_pages"] == n, b.counters
    # The second time B reads its own replicas.
    hit, done, _ = prefetch(controller(b, pool_b), pool_b, toks)
    assert done == n and b.counters["local_hits"] == n, b.counters
    # A prompt sharing 2 pages, then different: SGLang's chained keys stop the hit there.
    other = toks[: 2 * PAGE] + tokens(2, 3)
    hit, done, _ = prefetch(controller(b, pool_b), pool_b, other)
    assert (hit, done) == (2 * PAGE, 2), (hit, done)
    # Storing the same pages again keeps one copy per agent.
    assert backup(controller(a, pool_a), src, toks) == n * PAGE
    assert a.counters["already_present_pages"] == n, a.counters
    out["keys"] = get_storage_hash_str(toks, None, page_size=PAGE)
    out["counters_a"], out["counters_b"] = a.counters, b.counters
    out["namespace"] = [a.ns.tenant, a.ns.model]
    a.close()
    b.close()


@scenario
def interface_v1(out: Dict[str, Any]) -> None:
    """The zero-copy path (extra config interface_v1=1): batch_set_v1 / batch_get_v1."""
    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    a, b = attach("a", pool_a, interface_v1=1), attach("b", pool_b, interface_v1=1)
    n = 3
    toks = tokens(3, n)
    src = fill(pool_a, n)
    assert backup(controller(a, pool_a, zero_copy=True), src, toks) == n * PAGE
    hit, done, dst = prefetch(controller(b, pool_b, zero_copy=True), pool_b, toks)
    assert (hit, done) == (n * PAGE, n), (hit, done, b.counters)
    for i in range(n):
        assert page_bytes(pool_b, dst, i) == page_bytes(pool_a, src, i), f"page {i} differs"
    a.close()
    b.close()


@scenario
def sglang_unit_test_adapted(out: Dict[str, Any]) -> None:
    """SGLang's aibrix_kvcache/unit_test.py (test_with_page_size) against kvcm: its plain
    string keys, batch_exists / batch_set / batch_get and the partial-key checks; the pages
    have the agents' geometry instead of its 64 x 128 fp16."""
    pool = mha_host_pool()
    store = attach("a", pool)
    batch_size = 2
    query_length = batch_size * 2
    partial = batch_size
    shape = (pool.get_dummy_flat_data_page().numel(),)
    rand_tensor = [torch.rand(shape, dtype=torch.float32).to(torch.bfloat16)
                   for _ in range(query_length)]
    keys = ["hash" + str(i) for i in range(query_length)]
    partial_keys = keys[batch_size:query_length]
    assert store.batch_exists(keys) == 0
    assert store.batch_set(keys, rand_tensor)
    get_tensor = [torch.rand(shape).to(torch.bfloat16).flatten() for _ in range(query_length)]
    store.batch_get(keys, get_tensor)
    for i in range(query_length):
        assert torch.equal(get_tensor[i], rand_tensor[i].flatten())
    assert store.batch_exists(keys) == query_length
    assert store.batch_exists(partial_keys) == partial
    partial_get_tensor = [torch.rand(shape).to(torch.bfloat16).flatten() for _ in range(partial)]
    store.batch_get(partial_keys, partial_get_tensor)
    for i in range(partial):
        assert torch.equal(partial_get_tensor[i], rand_tensor[i + partial].flatten())
    # HiCacheFile-style single-key calls.
    assert store.exists("hash0") and not store.exists("hash-missing")
    assert torch.equal(store.get("hash1", torch.empty(shape, dtype=torch.bfloat16)),
                       rand_tensor[1])
    assert store.get("hash-missing", torch.empty(shape, dtype=torch.bfloat16)) is None
    store.close()


@scenario
def failure_injector(out: Dict[str, Any]) -> None:
    """SGLang's HiCacheStorageFailureInjector (its test env vars) around kvcm: a failed call
    stores or returns nothing, and what does come back is always the right bytes."""
    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = "1.0"
    try:
        a = attach("a", pool_a)
        assert isinstance(a, HiCacheStorageFailureInjector), type(a)
        toks = tokens(5, 2)
        src = fill(pool_a, 2)
        assert backup(controller(a, pool_a), src, toks) == 0
        assert a._backend.counters["stored_pages"] == 0
        a.close()
        os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = "0.3"
        os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"] = "0.01"
        a, b = attach("a", pool_a), attach("b", pool_b)
        assert isinstance(b, HiCacheStorageFailureInjector), type(b)
        stored = fetched = 0
        for seed in range(8):
            toks = tokens(100 + seed, 2)
            src = fill(pool_a, 2)
            stored += backup(controller(a, pool_a), src, toks) // PAGE
            hit, done, dst = prefetch(controller(b, pool_b), pool_b, toks)
            for i in range(done):
                assert page_bytes(pool_b, dst, i) == page_bytes(pool_a, src, i)
            fetched += done
        out["stored_pages"], out["fetched_pages"] = stored, fetched
        a.close()
        b.close()
    finally:
        os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
        os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)


def agent_used_bytes(backend: KvcmHiCacheStorage) -> int:
    return backend.agent.stats().used_bytes


@scenario
def wrong_page_size(out: Dict[str, Any]) -> None:
    """A page of another size is refused, counted, and changes nothing (no block, no page)."""
    pool = mha_host_pool()
    a = attach("a", pool)
    page = pool.get_dummy_flat_data_page()
    before = agent_used_bytes(a)
    short = torch.zeros(page.numel() - 1, dtype=page.dtype)
    assert not a.set("wrong-size", short)
    assert not a.batch_set(["ok-0", "wrong-size-2"], [page.clone(), torch.zeros(3)])
    assert a.counters["refused_page_size"] == 2, a.counters
    assert not a.exists("wrong-size") and not a.exists("ok-0") and not a.exists("wrong-size-2")
    assert agent_used_bytes(a) == before
    # A target of the wrong size is refused too, and the page stays.
    assert a.set("right-size", page.clone())
    assert a.get("right-size", torch.empty(page.numel() + 8, dtype=page.dtype)) is None
    assert a.counters["refused_page_size"] == 3, a.counters
    assert a.exists("right-size")
    out["counters"] = a.counters
    a.close()


@scenario
def other_tenant(out: Dict[str, Any]) -> None:
    """Tenant B asks for keys tenant A stored (SGLang's keys are the same strings): a miss,
    counted, no fetch, nothing changed; tenant A still gets them."""
    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    a = attach("a", pool_a)
    b = attach("b", pool_b, tenant="intruder")
    toks = tokens(7, 2)
    src = fill(pool_a, 2)
    assert backup(controller(a, pool_a), src, toks) == 2 * PAGE
    before = agent_used_bytes(b)
    hit, done, _ = prefetch(controller(b, pool_b), pool_b, toks)
    assert (hit, done) == (0, 0), (hit, done)
    keys = get_storage_hash_str(toks, None, page_size=PAGE)
    assert b.get(keys[0], pool_b.get_dummy_flat_data_page()) is None
    assert b.counters["misses"] >= 1 and b.counters["fetched_pages"] == 0, b.counters
    assert agent_used_bytes(b) == before
    assert a.batch_exists(keys) == 2
    out["namespace_b"] = [b.ns.tenant, b.ns.model]
    out["counters_b"] = b.counters
    a.close()
    b.close()


@scenario
def layouts_and_threads(out: Dict[str, Any]) -> None:
    """A layer_first engine's pages live in another namespace than page_first ones (their
    bytes are ordered differently); one backend serves SGLang's prefetch and backup threads
    at once."""
    import threading

    pool_l = mha_host_pool("layer_first")
    lf = attach("b", pool_l)
    out["namespace"] = [lf.ns.tenant, lf.ns.model]
    toks = tokens(1, 5)  # factory_round_trip stored these from a page_first engine
    hit, done, _ = prefetch(controller(lf, pool_l), pool_l, toks)
    assert (hit, done) == (0, 0), (hit, done)
    lf.close()

    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    a, b = attach("a", pool_a), attach("b", pool_b)
    errors: List[str] = []
    lock = threading.Lock()  # SGLang's host pool allocator is the scheduler's, not shared

    def engine_pair(seed: int) -> None:
        try:
            with lock:
                src = fill(pool_a, 3)
            toks = tokens(1000 + seed, 3)
            assert backup(controller(a, pool_a), src, toks) == 3 * PAGE
            c = controller(b, pool_b)
            op = PrefetchOperation(f"req{seed}", toks)
            keys, hit_tokens = HiCacheController._storage_hit_query(c, op)
            assert hit_tokens == 3 * PAGE, hit_tokens
            with lock:
                op.hash_value, op.host_indices = keys, pool_b.alloc(3 * PAGE)
            assert HiCacheController._page_transfer(c, op) == 3
            for i in range(3):
                assert page_bytes(pool_b, op.host_indices, i) == page_bytes(pool_a, src, i)
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=engine_pair, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert b.counters["fetched_pages"] == 18 and b.counters["errors"] == 0, b.counters
    a.close()
    b.close()


@scenario
def mla_latent_pages(out: Dict[str, Any]) -> None:
    """An MLA (DeepSeek-shaped latent: 512 + 64 rope) host pool: the namespace is MLA and a
    page costs its latent bytes, 576 x layers x page x 2, on the agent."""
    pool = mla_host_pool()
    # The MHA scenarios' namespace refuses an MLA layout: SGLang's pages would be misread.
    try:
        attach("mla", pool, mla=True)
        raise AssertionError("an MLA pool attached to an MHA namespace")
    except ValueError as e:
        assert "refuses" in str(e), e
    # An agent whose blocks are MHA pages refuses it too.
    try:
        attach("a", pool, mla=True, model=CFG["model"] + "-mla")
        raise AssertionError("an MLA pool attached to an MHA agent")
    except ValueError as e:
        assert "blocks are" in str(e), e
    m = attach("mla", pool, mla=True, model=CFG["model"] + "-mla")
    g = CFG["mla"]
    want = (g["kv_lora_rank"] + g["rope_dim"]) * g["layers"] * PAGE * 2
    assert m.bytes_per_page == want and m.spec.bytes_per_page() == want, (m.bytes_per_page,
                                                                          m.spec)
    assert m.spec.attention == kvcm.AttentionKind.MLA
    before = agent_used_bytes(m)
    toks = tokens(9, 2)
    src = fill(pool, 2)
    assert backup(controller(m, pool), src, toks) == 2 * PAGE
    out["used_bytes_delta"] = agent_used_bytes(m) - before
    hit, done, dst = prefetch(controller(m, pool), pool, toks)
    assert done == 2
    for i in range(2):
        assert page_bytes(pool, dst, i) == page_bytes(pool, src, i)
    out["bytes_per_page"] = want
    out["namespace"] = [m.ns.tenant, m.ns.model]
    m.close()


FULL_PROMPTS = 20  # 2 shared + 40 own pages into the small pool
# Then earlier prompts again: the last two (kept whole), the oldest (their own pages
# evicted), one twice (stored again by its first lookup's miss).
FULL_SECOND_PASS = (19, 18, 0, 1, 5, 19, 2, 0)


def full_pool_tokens(j: int) -> List[int]:
    """One of two system pages (alternately), then 2 pages of prompt j's own."""
    system = [((j % 2) * 7919 + i * 31 + 7) % 32000 for i in range(PAGE)]
    return system + [(j * 104729 + i * 37 + 3) % 32000 for i in range(2 * PAGE)]


@scenario
def full_pool(out: Dict[str, Any]) -> None:
    """Agent "small" holds CFG["small_pages"] pages, a fraction of what SGLang's backups
    (HiCacheController._page_backup) store here: every backup completes, also long after
    the pool filled (the agent's Allocate waits while the manager evicts by its policy).
    Then SGLang's prefetch of earlier prompts (_storage_hit_query: batch_exists; then
    _page_transfer: batch_get) hits exactly the leading pages the manager's index holds
    (a probe Match of each key, asked here directly), with the bytes stored; a prompt
    that missed is backed up again, evicting others."""
    pool = mha_host_pool()
    s = attach("small", pool, model=CFG["model"] + "-full")
    c = controller(s, pool)
    probe = kvcm.Client(CFG["manager"], insecure=True)
    probe.register_model(s.ns, s.spec)
    key = probe._require_key(s.ns).key
    from kvcm.sglang.hicache import page_hash

    def held(toks: List[int]) -> int:
        """Leading pages of the prompt the manager's index has on agent small."""
        n = 0
        for k in get_storage_hash_str(toks, None, page_size=PAGE):
            m = probe.match(s.ns, page_hashes=[page_hash(key, k)], requester_agent_id="small",
                            probe=True)
            if m.local_pages == 0:
                break
            n += 1
        return n

    # A system page's KV is the same in every prompt that starts with it.
    system = {g: fill(pool, 1) for g in (0, 1)}
    src: Dict[int, torch.Tensor] = {}
    stored: List[int] = []
    for j in range(FULL_PROMPTS):
        src[j] = fill(pool, 3)
        pool.set_from_flat_data_page(src[j][0], pool.get_data_page(system[j % 2][0],
                                                                   flat=True))
        before = s.counters["stored_pages"]
        assert backup(c, src[j], full_pool_tokens(j)) == 3 * PAGE, (j, s.counters)
        stored.append(s.counters["stored_pages"] - before)
    out["stored_per_prompt"] = stored
    out["held_after_first_pass"] = [held(full_pool_tokens(j)) for j in range(FULL_PROMPTS)]

    # The pool is full; backing up the last prompt again, which it holds whole, allocates
    # no block, so it evicts nothing.
    assert s.agent.stats().free_blocks == 0
    last = FULL_PROMPTS - 1
    before = dict(s.counters)
    assert backup(c, src[last], full_pool_tokens(last)) == 3 * PAGE
    assert s.counters["stored_pages"] == before["stored_pages"], (before, s.counters)
    assert s.counters["already_present_pages"] == before["already_present_pages"] + 3
    assert s.agent.stats().free_blocks == 0
    # What the index holds is not asserted unchanged here: the test's claim is that nothing
    # was allocated. A difference is reported (CI saw one once, not reproduced since).
    out["held_changed"] = [(j, a, b) for j, (a, b) in enumerate(zip(
        out["held_after_first_pass"], [held(full_pool_tokens(j)) for j in range(FULL_PROMPTS)]))
                           if a != b]

    hits: List[int] = []
    for j in FULL_SECOND_PASS:
        toks = full_pool_tokens(j)
        want = held(toks)
        hit, done, dst = prefetch(c, pool, toks)
        assert (hit, done) == (want * PAGE, want), (j, hit, done, want, s.counters)
        for i in range(done):
            assert page_bytes(pool, dst, i) == page_bytes(pool, src[j], i), (j, i)
        pool.free(dst)
        hits.append(done)
        if done < 3:  # SGLang computes the rest and backs the prompt up again
            assert backup(c, src[j], toks) == 3 * PAGE, (j, s.counters)
    out["second_pass_hits"] = hits
    out["counters"] = s.counters
    out["namespace"] = [s.ns.tenant, s.ns.model]
    probe.close()
    s.close()


@scenario
def tls_tokens_round_trip(out: Dict[str, Any]) -> None:
    """The secured cluster (manager and agents sa, sb with mutual TLS and tokens), with the
    extra config's tls_ca_file / tls_cert_file / tls_key_file / token_file (a worker of
    tenant acme): SGLang's backup stores through agent sa, SGLang's prefetch on agent sb
    fetches the pages from sa (agent to agent over mutual TLS) and reads them byte for
    byte."""
    os.environ.pop("KVCM_TOKEN", None)
    pool_a, pool_b = mha_host_pool(), mha_host_pool()
    a = attach("sa", pool_a, config=secure_config("sa", "acme"))
    b = attach("sb", pool_b, config=secure_config("sb", "acme"))
    n = 3
    toks = tokens(21, n)
    src = fill(pool_a, n)
    assert backup(controller(a, pool_a), src, toks) == n * PAGE, a.counters
    assert a.counters["stored_pages"] == n, a.counters
    hit, done, dst = prefetch(controller(b, pool_b), pool_b, toks)
    assert (hit, done) == (n * PAGE, n), (hit, done, b.counters)
    for i in range(n):
        assert page_bytes(pool_b, dst, i) == page_bytes(pool_a, src, i), f"page {i} differs"
    assert b.counters["fetched_pages"] == n and b.counters["errors"] == 0, b.counters
    out["namespace"] = [a.ns.tenant, a.ns.model]
    out["counters_a"], out["counters_b"] = a.counters, b.counters
    a.close()
    b.close()


@scenario
def tls_tokens_refused(out: Dict[str, Any]) -> None:
    """No token, an unknown token, and another tenant's worker token: SGLang's attach
    (factory, then register_mem_pool_host) fails with an error naming the refusal, and
    SGLang's backup through the unattached backend stores nothing: the agent's used bytes
    and the index are unchanged."""
    os.environ.pop("KVCM_TOKEN", None)
    pool = mha_host_pool()
    good = attach("sa", pool, config=secure_config("sa", "acme"))
    used = good.agent.stats().used_bytes
    toks = tokens(22, 2)
    keys = get_storage_hash_str(toks, None, page_size=PAGE)
    src = fill(pool, 2)
    errors: Dict[str, str] = {}
    for who in (None, "wrong", "globex"):
        backend = StorageBackendFactory.create_backend("dynamic", secure_config("sa", who),
                                                       pool)
        try:
            backend.register_mem_pool_host(pool)
            raise AssertionError(f"attached with token {who}")
        except ValueError as e:
            errors[str(who)] = str(e)
        assert backup(controller(backend, pool), src, toks) == 0
        assert backend.counters["refused_unattached"] == 2, backend.counters
        assert backend.counters["stored_pages"] == 0, backend.counters
        backend.close()
    assert good.agent.stats().used_bytes == used
    assert good.batch_exists(keys) == 0
    out["errors"] = errors
    good.close()


with open(sys.argv[2], "w") as f:
    json.dump(RESULTS, f, indent=1)
