"""kvcm.router units: tokenizers, load tracking, the hash ring, every policy, the imbalance
guard, and kv-aware's fallback (with a fake index, and with the manager down)."""

from __future__ import annotations

import asyncio
import random
from typing import List, Sequence

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from conftest import free_port  # noqa: E402

from kvcm.router import (  # noqa: E402
    ConsistentHashPolicy,
    HashRing,
    ImbalanceGuard,
    IndexUnavailable,
    KvAwarePolicy,
    LeastLoadedPolicy,
    LoadTracker,
    RoundRobinPolicy,
    Router,
    RoutingRequest,
    WordTokenizer,
    cacheable_tokens,
)
from kvcm.router.metrics import RouterMetrics  # noqa: E402
from kvcm.router.policy import prefix_key  # noqa: E402
from kvcm.router.tokenizer import (  # noqa: E402
    ByteTokenizer,
    TokenizerError,
    has_non_text_parts,
    load_tokenizer,
    prompt_tokens,
    render_simple_chat,
)
from kvcm.types import RankedAgent, RouteCandidate  # noqa: E402

ENGINES = ["e0", "e1", "e2"]


def request(seed: int, n: int = 64, **kw) -> RoutingRequest:
    rng = random.Random(seed)
    return RoutingRequest([rng.randrange(50000) for _ in range(n)], **kw)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FixedIndex:
    """Ranks engines in a fixed order with fixed cached pages; records what it was sent."""

    def __init__(self, order: Sequence[str], cached_pages: int = 0) -> None:
        self.order = list(order)
        self.cached_pages = cached_pages
        self.calls: List[List[RouteCandidate]] = []

    async def rank(self, request: RoutingRequest,
                   candidates: Sequence[RouteCandidate]) -> List[RankedAgent]:
        self.calls.append(list(candidates))
        ids = {c.agent_id: c for c in candidates}
        return [RankedAgent(e, self.cached_pages if i == 0 else 0, 0, 0, 0.0, 0.0, 0.0,
                            ids[e].load, 0.0)
                for i, e in enumerate(self.order) if e in ids]


class DownIndex:
    async def rank(self, request, candidates):
        raise IndexUnavailable("unavailable", "manager down")


# -- tokenizers -----------------------------------------------------------------------------


def test_word_tokenizer_is_deterministic_and_one_token_per_word():
    t = WordTokenizer()
    ids = t.encode("the quick  brown\nfox the")
    assert len(ids) == 5 and ids[0] == ids[4] and len(set(ids)) == 4
    assert ids == WordTokenizer().encode("the quick brown fox the")
    assert all(0 <= i < 2**31 for i in ids)


def test_chat_template_and_prompt_fields():
    t = WordTokenizer()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    assert render_simple_chat(msgs) == "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"
    assert prompt_tokens(t, {"messages": msgs}, chat=True) == t.encode(render_simple_chat(msgs))
    assert prompt_tokens(t, {"prompt": "a b c"}, chat=False) == t.encode("a b c")
    assert prompt_tokens(t, {"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert prompt_tokens(t, {"prompt": ["a b"]}, chat=False) == t.encode("a b")
    assert ByteTokenizer().encode("hé") == [104, 195, 169]
    for body, chat, field in [({}, False, "prompt"), ({"prompt": ["a", "b"]}, False, "prompt"),
                              ({"prompt": 3}, False, "prompt"), ({"messages": []}, True,
                                                                 "messages"),
                              ({"messages": [{"content": "x"}]}, True, "messages[0].role"),
                              ({"messages": [{"role": "user", "content": ["x"]}]}, True,
                               "messages[0].content[0]")]:
        with pytest.raises(TokenizerError, match=field.replace("[", r"\[").replace("]", r"\]")):
            prompt_tokens(t, body, chat)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}},
                                          {"type": "text", "text": "what is it"}]}]
    assert prompt_tokens(t, {"messages": image}, chat=True) == t.encode(
        "<|user|>\nwhat is it\n<|assistant|>\n")
    assert has_non_text_parts(image) and not has_non_text_parts(msgs)
    with pytest.raises(TokenizerError, match="tokenizer: required"):
        load_tokenizer("")


def test_hugging_face_tokenizer_from_a_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "BOS": 3, "user": 4, "assistant": 5, ":": 6}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    from kvcm.router.tokenizer import HuggingFaceTokenizer

    hf = load_tokenizer(str(tmp_path))
    assert isinstance(hf, HuggingFaceTokenizer)
    assert hf.encode("hello world zebra") == [1, 2, 0]
    # No chat template: the simple one, whose markers are unknown words here.
    assert hf.encode_chat([{"role": "user", "content": "hello"}]) == hf.encode(
        render_simple_chat([{"role": "user", "content": "hello"}]))
    pytest.importorskip("jinja2")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "BOS", "chat_template": "{{ bos_token }} {% for m in messages %}'
        '{{ m.role }} : {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant :'
        '{% endif %}"}')
    hf = load_tokenizer(str(tmp_path))
    assert hf.encode_chat([{"role": "user", "content": "hello world"}]) == [3, 4, 6, 1, 2, 5, 6]


# -- load -----------------------------------------------------------------------------------


def test_load_tracker_counts_and_health():
    clock = FakeClock()
    loads = LoadTracker(ENGINES, down_s=1.0, max_down_s=3.0, clock=clock)
    t = loads.begin("e1", prompt_tokens=100, expected_cached_tokens=30)
    assert (loads.in_flight("e1"), loads.queued_prefill_tokens("e1")) == (1, 70)
    loads.prefill_done(t)
    loads.prefill_done(t)
    assert (loads.in_flight("e1"), loads.queued_prefill_tokens("e1")) == (1, 0)
    loads.end(t)
    loads.end(t)
    assert (loads.in_flight("e1"), loads.queued_prefill_tokens("e1")) == (0, 0)
    t = loads.begin("e0", 10, 50)
    assert loads.queued_prefill_tokens("e0") == 0  # never negative
    loads.end(t)

    assert [loads.mark_down("e0") for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert loads.available() == ["e1", "e2"]
    clock.now += 3.0
    assert loads.available() == ENGINES  # tried again after the period
    loads.mark_down("e0")
    loads.mark_up("e0")
    assert loads.is_up("e0") and loads.mark_down("e0") == 1.0
    for e in ENGINES:
        loads.mark_down(e)
    assert loads.available() == ENGINES  # all down: try them all rather than refuse


# -- ring and baselines ---------------------------------------------------------------------


def test_hash_ring_moves_only_the_arcs_of_a_changed_engine():
    keys = [random.Random(i).getrandbits(64) for i in range(4000)]
    three = HashRing(["a", "b", "c"])
    four = HashRing(["a", "b", "c", "d"])
    before = {k: three.owner(k) for k in keys}
    after = {k: four.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)
    assert 0.15 < len(moved) / len(keys) < 0.35
    # Removing d again gives every key back to its old owner; a ring is order-independent.
    assert {k: HashRing(["c", "a", "b"]).owner(k) for k in keys} == before
    shares = {e: sum(1 for k in keys if before[k] == e) / len(keys) for e in "abc"}
    assert all(0.22 < s < 0.45 for s in shares.values()), shares
    walk = three.walk(keys[0])
    assert sorted(walk) == ["a", "b", "c"] and walk[0] == before[keys[0]]


@pytest.mark.asyncio
async def test_consistent_hash_keeps_a_prefix_on_one_engine_and_separates_salts():
    loads = LoadTracker(ENGINES)
    policy = ConsistentHashPolicy(ENGINES, page_size=16)
    shared = request(1, 16).tokens
    owners = set()
    for seed in range(20):  # same first page, different rest
        r = RoutingRequest(list(shared) + request(seed + 100, 40).tokens)
        owners.add((await policy.choose(r, ENGINES, loads)).engine_id)
    assert len(owners) == 1
    salted = {(await policy.choose(RoutingRequest(shared, cache_salt=f"s{i}"), ENGINES,
                                   loads)).engine_id for i in range(30)}
    assert len(salted) > 1  # salts hash apart
    owner = owners.pop()
    others = [e for e in ENGINES if e != owner]
    d = await policy.choose(RoutingRequest(shared), others, loads)  # owner unavailable
    assert d.engine_id in others and d.reason == "policy"
    ring_order = HashRing(ENGINES).walk(prefix_key(RoutingRequest(shared), 16))
    assert d.engine_id == [e for e in ring_order if e != owner][0]


@pytest.mark.asyncio
async def test_round_robin_and_least_loaded():
    loads = LoadTracker(ENGINES)
    rr = RoundRobinPolicy()
    assert [(await rr.choose(request(0), ENGINES, loads)).engine_id for _ in range(6)] == \
        ENGINES * 2
    ll = LeastLoadedPolicy()
    picks = []
    for _ in range(6):  # idle engines share: ties rotate
        d = await ll.choose(request(0), ENGINES, loads)
        loads.begin(d.engine_id, 10, 0)
        picks.append(d.engine_id)
    assert sorted(picks) == sorted(ENGINES * 2)
    t = loads.begin("e0", 10, 0)
    loads.end(t)
    loads.begin("e1", 1000, 0)  # e1 busiest; e0 and e2 tie on count, e0 has fewer tokens
    loads.begin("e2", 500, 0)
    loads.begin("e0", 100, 0)
    assert (await ll.choose(request(0), ENGINES, loads)).engine_id == "e0"


# -- kv-aware -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_kv_aware_follows_the_index_and_caps_expected_hits():
    index = FixedIndex(["e2", "e0", "e1"], cached_pages=4)
    policy = KvAwarePolicy(index, page_size=16, block_size=16)
    loads = LoadTracker(ENGINES)
    loads.begin("e0", 100, 20)
    d = await policy.choose(request(0, n=64), ENGINES, loads)
    assert (d.engine_id, d.reason, d.expected_cached_tokens) == ("e2", "policy", 48)
    assert cacheable_tokens(64, 16) == 48 and cacheable_tokens(65, 16) == 64
    sent = {c.agent_id: c for c in index.calls[0]}
    assert (sent["e0"].load, sent["e0"].queued_prefill_tokens) == (1, 80)


@pytest.mark.asyncio
async def test_imbalance_guard_spreads_a_hot_prefix_once_in_flight_builds():
    index = FixedIndex(["e0", "e1", "e2"], cached_pages=2)  # e0 always holds the prefix
    loads = LoadTracker(ENGINES)
    router = Router(KvAwarePolicy(index, page_size=16, block_size=16,
                                  guard=ImbalanceGuard(factor=2.0, margin=4)), loads)
    routed = [await router.route(request(0)) for _ in range(30)]  # nothing finishes
    chosen = [r.decision.engine_id for r in routed]
    assert chosen[:5] == ["e0"] * 5  # affinity while within the margin
    assert routed[5].decision.reason == "imbalance-guard" and chosen[5] == "e1"
    counts = {e: chosen.count(e) for e in ENGINES}
    assert all(counts[e] >= 3 for e in ENGINES), counts
    # The bound holds all along: max <= 2 * min + 4 + 1 (the request that reached it).
    assert max(counts.values()) <= 2 * min(counts.values()) + 5
    # Once e0's requests finish, affinity returns.
    for r in routed:
        router.finish(r.ticket)
    assert (await router.route(request(0))).decision.engine_id == "e0"
    # Without the guard, everything follows the prefix.
    loads2 = LoadTracker(ENGINES)
    unguarded = KvAwarePolicy(index, page_size=16, block_size=16)
    for _ in range(20):
        d = await unguarded.choose(request(0), ENGINES, loads2)
        loads2.begin(d.engine_id, 64, 32)
        assert d.engine_id == "e0"


@pytest.mark.asyncio
async def test_consistent_hash_guard_is_bounded_load_hashing():
    loads = LoadTracker(ENGINES)
    policy = ConsistentHashPolicy(ENGINES, page_size=16, guard=ImbalanceGuard(1.0, 2))
    picks = []
    for _ in range(12):
        d = await policy.choose(request(5), ENGINES, loads)
        loads.begin(d.engine_id, 64, 0)
        picks.append(d)
    assert len({d.engine_id for d in picks}) == 3
    assert picks[0].reason == "policy" and any(d.reason == "imbalance-guard" for d in picks)


@pytest.mark.asyncio
async def test_kv_aware_falls_back_to_least_loaded_and_counts_it():
    metrics = RouterMetrics()
    loads = LoadTracker(ENGINES)
    loads.begin("e0", 10, 0)
    router = Router(KvAwarePolicy(DownIndex(), page_size=16, block_size=16), loads, metrics)
    d = (await router.route(request(0), endpoint="/v1/completions")).decision
    assert (d.engine_id, d.reason, d.fallback_cause) == ("e1", "fallback", "unavailable")
    index = FixedIndex(ENGINES, cached_pages=3)
    images = KvAwarePolicy(index, page_size=16, block_size=16)
    d = await images.choose(RoutingRequest(request(0).tokens, hashable=False), ENGINES,
                            LoadTracker(ENGINES))
    assert (d.reason, d.fallback_cause, d.expected_cached_tokens) == ("fallback",
                                                                      "unhashable", 0)
    assert index.calls == []
    value = metrics.registry.get_sample_value
    assert value("kvcm_router_manager_fallbacks_total", {"cause": "unavailable"}) == 1
    assert value("kvcm_router_requests_total", {"engine": "e1", "policy": "kv-aware",
                                                "endpoint": "/v1/completions"}) == 1
    assert value("kvcm_router_in_flight_requests", {"engine": "e1"}) == 1


@pytest.mark.asyncio
async def test_manager_index_falls_back_fast_when_the_manager_is_down():
    import kvcm.aio
    from kvcm.router.manager_index import ManagerIndex
    from kvcm.types import ModelSpec, Namespace

    client = kvcm.aio.Client(f"127.0.0.1:{free_port()}", insecure=True,
                             default_deadline_ms=200, max_attempts=2)
    index = ManagerIndex(client, Namespace("t", "m"), ModelSpec.llama3_8b(page_size_tokens=16),
                         block_size=16, prefill_tokens_per_s=1000, route_deadline_ms=200,
                         retry_s=30)
    assert not await index.register()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(IndexUnavailable) as e:
        await index.rank(request(0), [RouteCandidate("e0"), RouteCandidate("e1")])
    assert e.value.cause == "unavailable" and loop.time() - start < 1.0
    start = loop.time()
    with pytest.raises(IndexUnavailable):  # not asked again for retry_s: at once
        await index.rank(request(0), [RouteCandidate("e0")])
    assert loop.time() - start < 0.05
    # A prompt under one page needs no manager: every engine holds 0 pages of it.
    ranked = await index.rank(request(0, n=8), [RouteCandidate("e0", 0, 500),
                                                RouteCandidate("e1", 0, 100)])
    assert [r.agent_id for r in ranked] == ["e1", "e0"]
    await client.close()


@pytest.mark.asyncio
async def test_manager_index_ranks_engines_without_a_session_locally(manager):
    """Engines the manager has no live session for are not an error: they hold nothing."""
    import kvcm.aio
    from kvcm.router.manager_index import ManagerIndex
    from kvcm.types import ModelSpec, Namespace

    async with kvcm.aio.Client(manager.address, insecure=True) as client:
        index = ManagerIndex(client, Namespace("acme", "llama"),
                             ModelSpec.llama3_8b(page_size_tokens=16), block_size=16,
                             prefill_tokens_per_s=1000)
        assert await index.register() and index.has_key
        cands = [RouteCandidate("e0", 3, 4000), RouteCandidate("e1", 1, 1000),
                 RouteCandidate("e2", 0, 1000)]
        ranked = await index.rank(request(0, n=64), cands)
        assert [r.agent_id for r in ranked] == ["e2", "e1", "e0"]
        assert [r.cached_pages for r in ranked] == [0, 0, 0]
        assert ranked[2].queue_ms == pytest.approx(4000.0)


# -- configuration --------------------------------------------------------------------------


def test_config_from_toml_and_flags(tmp_path):
    from kvcm.router.config import ConfigError, load_config

    path = tmp_path / "router.toml"
    path.write_text('''
policy = "kv-aware"
tokenizer = "words"
engines = ["e0=http://10.0.0.5:8000/v1", "e1=https://e1.internal:8443"]
lora_adapters = ["sql-lora"]
manager_address = "kvcm:50051"
insecure = true
token = "0123456789abcdef0123"
imbalance_margin = 8
[namespace]
tenant = "acme"
model = "llama"
preset = "llama-3-8b"
page_size_tokens = 32
block_size = 16
''')
    cfg = load_config(["--config", str(path), "--listen_address", "0.0.0.0:9000",
                       "--imbalance-factor", "3"])
    assert [(e.id, e.url) for e in cfg.engines] == [("e0", "http://10.0.0.5:8000"),
                                                   ("e1", "https://e1.internal:8443")]
    assert (cfg.imbalance_factor, cfg.imbalance_margin, cfg.listen_host_port) == (
        3.0, 8, ("0.0.0.0", 9000))
    assert cfg.namespace.model_spec().page_size_tokens == 32 and "0123" not in repr(cfg)
    cfg = load_config(["--config", str(path), "--engine", "x=http://h:1", "--page_size_tokens", "16"])
    assert [e.id for e in cfg.engines] == ["x"] and cfg.namespace.page_tokens == 16
    for extra, message in [
        (["--page_size_tokens", "24"], "namespace.page_size_tokens: 24 must be a multiple"),
        (["--policy", "fastest"], "invalid choice"),
        (["--token_file", "/t"], "token: give token or token_file, not both"),
        (["--engine", "e0=http://a:1", "--engine", "e0=http://b:1"], "'e0' is listed twice"),
        (["--engine", "e0=ftp://a:1"], "must be http(s)://HOST:PORT"),
        (["--listen_address", "nowhere"], "listen_address 'nowhere' has no port; kvcm-router "
                                          "listens on 8100 by default: nowhere:8100"),
    ]:
        with pytest.raises((ConfigError, SystemExit)) as e:
            load_config(["--config", str(path), *extra])
        if isinstance(e.value, ConfigError):
            assert message in str(e.value), (extra, str(e.value))
    path.write_text('policy = "round-robin"\ntokenizer = "words"\nengines = ["e0=http://h:1"]\n'
                    '[namespace]\nsize = 3\n')
    with pytest.raises(ConfigError, match="namespace.size: unknown setting"):
        load_config(["--config", str(path)])
