"""A stand-in for vLLM's KV-event side, for tests and benchmarks.

- `FakeVllmPublisher` publishes event batches the way vLLM's `ZmqEventPublisher`
  (vllm/distributed/kv_events.py) does: a PUB socket sending `[topic, seq (8 bytes big-endian),
  payload]`, a ROUTER replay socket answering `[identity, b"", start_seq]` with every buffered
  batch from start_seq then an end marker, a bounded replay buffer, and the same
  bind-or-connect rule. Replay answers come in vLLM <= 0.25's form `[seq, payload]`, end
  `[-1, b""]` ("seq"), or >= 0.26's `[topic, seq, payload]`, end `[b"", -1, b""]` ("topic").
  Payloads are encoded with msgspec structs of the same shape as vLLM's, in one of three
  forms (`FORMS`). `wire_for_release` picks both for a release; tests/test_vllm_publishers.py
  checks them against frames captured from vLLM's own publisher.
- `FakeVllmEngine` is a tiny prefix cache with vLLM's block semantics (chained block hashes
  with extra keys, LRU eviction of unreferenced cached blocks, no deduplication), emitting
  BlockStored / BlockRemoved / AllBlocksCleared into a publisher.

Neither needs vLLM; both are single-process and meant for loopback.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import count
from typing import Any

from dataclasses import dataclass

import msgspec
import zmq

from kvcm.vllm import events as ev

# ---- vLLM's structs, three generations -------------------------------------------------
# "legacy": vLLM 0.9 - 0.10: events tagged arrays, BlockStored(block_hashes, parent_block_hash,
#           token_ids, block_size, lora_id), BlockRemoved(block_hashes).
# "array":  vLLM 0.11 - 0.23: events tagged arrays with medium, lora_name, extra_keys,
#           group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window appended over
#           releases (`array_fields` keeps a release's count).
# "map":    vLLM >= 0.24: events maps tagged by "type"; locality (0.26), ownership (0.29),
#           session_id (0.30), lookahead_token_ids (0.33) added.
# The batch is [ts, events, data_parallel_rank] in every release.


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


FORMS = ("legacy", "array", "map")
REPLAY_FORMS = ("seq", "topic")


@dataclass(frozen=True)
class Wire:
    form: str          # payload form, one of FORMS
    replay_form: str   # replay answer form, one of REPLAY_FORMS
    # Array form: how many BlockStored / BlockRemoved fields the release sends (None: all).
    array_fields: tuple[int, int] | None = None


# (first release seen with it, BlockStored fields, BlockRemoved fields) of the array form;
# docs/ENGINES.md has the table and which releases were checked.
_ARRAY_FIELDS = (((0, 11), 6, 2), ((0, 14), 7, 2), ((0, 17), 8, 2), ((0, 20), 9, 3),
                 ((0, 22), 11, 3))


def wire_for_release(version: str) -> Wire:
    """The payload and replay forms of a vLLM release (docs/ENGINES.md has the table)."""
    v = tuple(int(x) for x in version.split(".")[:2])
    replay = "seq" if v < (0, 26) else "topic"
    if v < (0, 11):
        return Wire("legacy", replay)
    if v >= (0, 24):
        return Wire("map", replay)
    fields = [(s, r) for first, s, r in _ARRAY_FIELDS if v >= first][-1]
    return Wire("array", replay, fields)


def encode_batch(form: str, events: Sequence[ev.Event], ts: float | None = None,
                 data_parallel_rank: int | None = 0,
                 array_fields: tuple[int, int] | None = None) -> bytes:
    """msgpack of a batch of events as a vLLM release of `form` encodes it (fields the form
    lacks are dropped). `array_fields`: the array form's BlockStored and BlockRemoved keep
    only their first n fields (releases before 0.22 sent fewer)."""
    ts = time.time() if ts is None else ts
    enc = msgspec.msgpack.encode
    if form == "legacy":
        out: list[Any] = []
        for e in events:
            if isinstance(e, ev.BlockStored):
                out.append(_LegacyBlockStored(list(e.block_hashes), e.parent_block_hash,
                                              list(e.token_ids), e.block_size, e.lora_id))
            elif isinstance(e, ev.BlockRemoved):
                out.append(_LegacyBlockRemoved(list(e.block_hashes)))
            else:
                out.append(_LegacyAllBlocksCleared())
        return enc(_Batch(ts, out, data_parallel_rank))
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; one of {FORMS}")
    arr = form == "array"
    stored, removed, cleared = ((_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared)
                                if arr else (_MapBlockStored, _MapBlockRemoved,
                                             _MapAllBlocksCleared))
    out = []
    for e in events:
        if isinstance(e, ev.BlockStored):
            kw: dict[str, Any] = dict(
                block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                medium=e.medium, lora_name=e.lora_name,
                extra_keys=None if e.extra_keys is None else list(e.extra_keys),
                group_idx=e.group_idx)
            kw["kv_cache_spec_kind"] = e.kv_cache_spec_kind
            kw["kv_cache_spec_sliding_window"] = e.kv_cache_spec_sliding_window
            if not arr:
                kw.update(locality=e.locality, ownership=e.ownership, session_id=e.session_id,
                          lookahead_token_ids=None if e.lookahead_token_ids is None else
                          [list(x) for x in e.lookahead_token_ids])
            out.append(_trim(stored(**kw), array_fields and array_fields[0]))
        elif isinstance(e, ev.BlockRemoved):
            rkw: dict[str, Any] = {} if arr else dict(locality=e.locality,
                                                      ownership=e.ownership)
            out.append(_trim(removed(list(e.block_hashes), e.medium, e.group_idx, **rkw),
                             array_fields and array_fields[1]))
        else:
            out.append(cleared())
    return enc(_Batch(ts, out, data_parallel_rank))


def _trim(event: Any, fields: int | None) -> Any:
    """An array-form event with only its tag and first `fields` fields."""
    if not fields:
        return event
    return msgspec.to_builtins(event)[:1 + fields]


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: data-parallel rank r publishes on port + r (inproc: a `_dp<r>` suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        i = endpoint.rfind(":")
        return f"{endpoint[:i]}:{int(endpoint[i + 1:]) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def publisher_binds(endpoint: str) -> bool:
    """vLLM's PUB rule: bind a wildcard, IPv6 `::`, ipc:// or inproc:// endpoint, else
    connect to it."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


class FakeVllmPublisher:
    """vLLM's ZmqEventPublisher, with test hooks. publish() may be called from any thread;
    the sockets live in one publisher thread, as in vLLM."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0, form: str = "map",
                 replay_form: str | None = None, release: str | None = None,
                 curve: tuple[bytes, bytes, bytes] | None = None):
        """`release` (a vLLM version) sets form and replay_form as that release's. `curve`:
        (server public, own public, own secret) key, to publish to a bridge over CURVE
        (vLLM itself has no such setting)."""
        self.array_fields: tuple[int, int] | None = None
        if release is not None:
            wire = wire_for_release(release)
            form, replay_form, self.array_fields = wire.form, wire.replay_form, \
                wire.array_fields
        if form not in FORMS:
            raise ValueError(f"unknown form {form!r}; one of {FORMS}")
        # By default the replay form of the newest release sending `form`.
        replay_form = replay_form or ("topic" if form == "map" else "seq")
        if replay_form not in REPLAY_FORMS:
            raise ValueError(f"unknown replay form {replay_form!r}; one of {REPLAY_FORMS}")
        self.form, self.replay_form = form, replay_form
        self.data_parallel_rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._queue: queue.Queue[tuple[bytes, bool] | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._topic = topic.encode()
        self._drop_live = 0
        self._lock = threading.Lock()
        self.replay_requests = 0
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self._pub.curve_serverkey, self._pub.curve_publickey, \
                self._pub.curve_secretkey = curve
        assert self.endpoint is not None
        if publisher_binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-vllm-pub")
        self._thread.start()

    def publish(self, events: Sequence[ev.Event], ts: float | None = None) -> None:
        """Queues one batch (vLLM: one per engine step with events)."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        payload = encode_batch(self.form, events, ts, self.data_parallel_rank,
                               self.array_fields)
        self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> None:
        """Queues raw bytes as a batch (garbage tests)."""
        with self._lock:
            drop = self._drop_live > 0
            self._drop_live -= 1 if drop else 0
        self._queue.put((payload, drop))

    def drop_live(self, n: int = 1) -> None:
        """The next n batches get a sequence number and enter the replay buffer, but never
        reach subscribers live (a lost message)."""
        with self._lock:
            self._drop_live += n

    def flush(self, timeout_s: float = 5.0) -> None:
        """Waits until every queued batch was sent."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._buffer[-1][0] + 1 if self._buffer else 0

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            payload, drop = item
            seq = next(self._seq)
            if not drop:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            with self._lock:
                self._buffer.append((seq, payload))
            self._queue.task_done()

    def _service_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            return
        client_id, _, start = frame
        start_seq = int.from_bytes(start, "big")
        self.replay_requests += 1
        with self._lock:
            items = [(s, p) for s, p in self._buffer if s >= start_seq]
        topic = (self._topic,) if self.replay_form == "topic" else ()
        end_topic = (b"",) if self.replay_form == "topic" else ()
        for s, p in items:
            self._replay.send_multipart((client_id, b"", *topic, s.to_bytes(8, "big"), p))
        self._replay.send_multipart((client_id, b"", *end_topic, self.END_SEQ, b""))


# ---- the engine ------------------------------------------------------------------------


class FakeVllmEngine:
    """A vLLM-like prefix cache of `num_blocks` blocks of `block_size` tokens (GPU), with an
    optional write-through CPU tier of `cpu_blocks` (events with medium "CPU" and no tokens,
    as vLLM's offloading connector sends). Requests finish as soon as they are processed.
    Not thread-safe."""

    def __init__(self, block_size: int = 16, num_blocks: int = 1024,
                 publisher: FakeVllmPublisher | None = None, *, form: str | None = None,
                 hash_seed: str = "kvcm-fake", int_hashes: bool = True, cpu_blocks: int = 0,
                 group_idx: int = 0, report_mode: str = "incremental"):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.publisher = publisher
        self.form = form or (publisher.form if publisher else "map")
        self.int_hashes = int_hashes
        self.group_idx = group_idx
        # "full": re-send BlockStored for a request's reused prefix (vLLM >= 0.26,
        # kv_cache_report_mode), with no new physical copy.
        self.report_mode = report_mode
        self._none_hash = hashlib.sha256(hash_seed.encode()).digest()
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, list[int]] = {}          # digest -> physical copies
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cpu_blocks = cpu_blocks
        self._cpu: OrderedDict[bytes, None] = OrderedDict()
        # Every block ever hashed: digest -> (parent digest, tokens, extras). For tests.
        self.meta: dict[bytes, tuple[bytes | None, tuple[int, ...], tuple | None]] = {}
        self.events: list[ev.Event] = []                     # every event, in order
        self.batches: list[list[ev.Event]] = []              # the same, batch by batch

    # -- hashing, as vllm/v1/core/kv_cache_utils.py (hash_block_tokens) --

    def block_digest(self, parent: bytes | None, tokens: Sequence[int],
                     extras: tuple | None) -> bytes:
        payload = msgspec.msgpack.encode([parent or self._none_hash, list(tokens), extras])
        return hashlib.sha256(payload).digest()

    def external(self, digest: bytes) -> int | bytes:
        """What events carry: the low 64 bits (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) or bytes."""
        return int.from_bytes(digest, "big") & ((1 << 64) - 1) if self.int_hashes else digest

    def extras_for(self, block_index: int, lora_name: str | None, lora_id: int | None,
                   cache_salt: str | None) -> tuple | None:
        """generate_block_hash_extra_keys for a text request: LoRA (the name; the integer id
        in the legacy form's releases) on every block, the salt on the first."""
        keys: list[Any] = []
        if self.form == "legacy":
            keys += [lora_id] if lora_id is not None else []
        elif lora_name:
            keys.append(lora_name)
        if block_index == 0 and cache_salt:
            keys.append(cache_salt)
        return tuple(keys) or None

    def request_digests(self, token_ids: Sequence[int], lora_name: str | None = None,
                        cache_salt: str | None = None,
                        lora_id: int | None = None) -> list[bytes]:
        out: list[bytes] = []
        parent = None
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            extras = self.extras_for(i, lora_name, lora_id, cache_salt)
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            d = self.block_digest(parent, tokens, extras)
            self.meta.setdefault(d, (parent, tokens, extras))
            out.append(d)
            parent = d
        return out

    # -- the cache --

    def process(self, token_ids: Sequence[int], lora_name: str | None = None,
                cache_salt: str | None = None, lora_id: int | None = None) -> int:
        """Runs one request (prefill, then finish). Returns the prompt tokens that were a
        prefix hit (vLLM keeps at least the last token to compute)."""
        bs = self.block_size
        digests = self.request_digests(token_ids, lora_name, cache_salt, lora_id)
        max_hit = max(0, (len(token_ids) - 1) // bs)
        hits = 0
        while hits < min(max_hit, len(digests)) and digests[hits] in self._cached:
            hits += 1
        out: list[ev.Event] = []
        if self.report_mode == "full" and hits:
            out.append(self._stored_event(digests[:hits], None, token_ids[:hits * bs],
                                          lora_name, lora_id))
        blocks: list[int] = []
        for d in digests[:hits]:
            b = self._cached[d][0]
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            blocks.append(b)
        needed = -(-len(token_ids) // bs) - hits
        if needed > len(self._free):
            for b in blocks:
                self._release(b)
            raise RuntimeError(f"request needs {needed} free blocks, {len(self._free)} left")
        new = []
        for _ in range(needed):
            b, _ = self._free.popitem(last=False)
            if self._hash_of[b] is not None:
                out.append(self._evict(b))
            self._ref[b] = 1
            new.append(b)
        blocks += new
        new_full = digests[hits:]
        for b, d in zip(new, new_full):
            self._hash_of[b] = d
            self._cached.setdefault(d, []).append(b)
        if new_full:
            out.append(self._stored_event(new_full, digests[hits - 1] if hits else None,
                                          token_ids[hits * bs:len(digests) * bs], lora_name,
                                          lora_id))
            if self._cpu_blocks:
                out += self._offload(new_full)
        for b in reversed(blocks):  # the chain's tail is evicted first, as vLLM frees
            self._release(b)
        self._emit(out)
        return hits * bs

    def clear(self) -> None:
        """reset_prefix_cache: every cached block (and the CPU tier) forgets its hash."""
        for b in range(self.num_blocks):
            self._hash_of[b] = None
        self._cached.clear()
        self._cpu.clear()
        self._emit([ev.AllBlocksCleared()])

    def cached_digests(self) -> set[bytes]:
        return set(self._cached)

    def cpu_digests(self) -> set[bytes]:
        return set(self._cpu)

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._free[b] = None

    def _evict(self, b: int) -> ev.Event:
        d = self._hash_of[b]
        assert d is not None
        copies = self._cached[d]
        copies.remove(b)
        if not copies:
            del self._cached[d]
        self._hash_of[b] = None
        return ev.BlockRemoved((self.external(d),), "GPU", self.group_idx)

    def _stored_event(self, digests: list[bytes], parent: bytes | None,
                      tokens: Sequence[int], lora_name: str | None,
                      lora_id: int | None) -> ev.Event:
        return ev.BlockStored(
            tuple(self.external(d) for d in digests),
            None if parent is None else self.external(parent), tuple(tokens), self.block_size,
            lora_id=lora_id, medium="GPU", lora_name=lora_name,
            extra_keys=tuple(self.meta[d][2] for d in digests), group_idx=self.group_idx,
            kv_cache_spec_kind="full_attention")

    def _offload(self, digests: list[bytes]) -> list[ev.Event]:
        out: list[ev.Event] = []
        stored = []
        for d in digests:
            if d in self._cpu:
                self._cpu.move_to_end(d)
                continue
            if len(self._cpu) >= self._cpu_blocks:
                old, _ = self._cpu.popitem(last=False)
                out.append(ev.BlockRemoved((self.external(old),), "CPU"))
            self._cpu[d] = None
            stored.append(self.external(d))
        if stored:
            out.append(ev.BlockStored(tuple(stored), None, (), 0, medium="CPU"))
        return out

    def _emit(self, events: list[ev.Event]) -> None:
        if not events:
            return
        self.events += events
        self.batches.append(events)
        if self.publisher is not None:
            self.publisher.publish(events)
