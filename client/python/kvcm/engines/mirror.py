"""One engine's prefix cache as kvcm sees it, rebuilt from its KV events (any engine kind).

`EngineMirror` keeps what the engine holds (per tier, with a copy count per vLLM block hash,
since an engine may cache one hash in several physical blocks) and the content of each held block
(parent, tokens, extra keys), derives each block's kvcm page hash from its chain to the
prompt start, and turns every change of what is *visible* into `Change` records shaped like
the manager's `EngineChange`.

A page is visible in a tier when every engine block in it is held there and the previous page
is visible (kvcm pools hold prefixes from page 0). A block whose chain to a prompt start is
not known is an orphan: kept, counted, and hashed once its ancestors arrive. A kvcm page is
k = page_size / block_size aligned engine blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

from kvcm import hashing
from kvcm.engines.events import (AllBlocksCleared, BlockHash, BlockRemoved, BlockStored,
                                 Event)
from kvcm.engines.kinds import VerifyBlock
from kvcm.engines.pagehash import (BlockExtras, blocks_per_page, canonical_extras,
                                normalize_extras, page_hash)

log = logging.getLogger(__name__)


class Tier(IntEnum):
    """Same numbers as kvcm.v1.Tier."""
    GPU = 1
    HOST = 2
    DISK = 3


class ChangeKind(IntEnum):
    """Same numbers as kvcm.v1.EngineChange.Kind."""
    STORED = 1
    REMOVED = 2
    CLEARED = 3


@dataclass(frozen=True)
class Change:
    """STORED: the pool now holds pages [0, n) of this chain. REMOVED: the chain's last page
    and everything under it left. CLEARED: the tier's whole pool left (no hashes). Hashes are
    16 bytes each, from page 0, as Prompt.page_hashes."""
    kind: ChangeKind
    tier: Tier
    page_hashes: bytes = b""

    @property
    def num_pages(self) -> int:
        return len(self.page_hashes) // 16


_GPU_MEDIUMS = {"GPU", "CUDA", "HBM", "DEVICE", "XPU", "NPU", "TPU"}
_HOST_MEDIUMS = {"CPU", "HOST", "DRAM", "RAM", "MEMORY", "CPU_PINNED", "PINNED"}
_DISK_WORDS = ("DISK", "SSD", "NVME", "STORAGE", "FILE", "FS")


def tier_of_medium(medium: str | None) -> Tier | None:
    """vLLM's `medium` as a kvcm tier: None/GPU -> GPU, CPU -> HOST, disk-like -> DISK,
    anything else None (refused: kvcm would not know what it holds)."""
    if medium is None:
        return Tier.GPU
    m = medium.strip().upper()
    if m in _GPU_MEDIUMS:
        return Tier.GPU
    if m in _HOST_MEDIUMS:
        return Tier.HOST
    if any(w in m for w in _DISK_WORDS):
        return Tier.DISK
    return None


class _Block:
    """A block whose content is known. Derived fields are set once its chain to a prompt
    start is known; depth -1 marks an orphan."""

    __slots__ = ("parent", "tokens", "extras", "depth", "page_prev", "acc_tokens",
                 "acc_extras", "khash", "state")

    def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...],
                 extras: BlockExtras) -> None:
        self.parent = parent
        self.tokens = tokens
        self.extras = extras
        self.depth = -1
        self.page_prev = b""                           # kvcm hash of the previous page
        self.acc_tokens: tuple[int, ...] = ()          # this page's tokens up to this block
        self.acc_extras: tuple[BlockExtras, ...] = ()  # their extras, one per block
        self.khash: bytes | None = None                # kvcm page hash if it ends a page
        self.state: object = None                      # the engine kind's verify state


@dataclass
class MirrorCounters:
    """Totals since the mirror was made (reset() keeps them)."""
    events: Counter = field(default_factory=Counter)         # by event type
    blocks_stored: int = 0
    blocks_removed: int = 0
    refused_blocks: Counter = field(default_factory=Counter)  # by reason
    ignored_events: Counter = field(default_factory=Counter)  # by reason
    unknown_removals: int = 0      # removals of blocks the mirror did not hold
    conflicts: int = 0             # a known hash stored again with other content
    # BlockStored of a block the tier already holds (vLLM >= 0.26 kv_cache_report_mode
    # "full" re-reports reused blocks): not a new copy.
    restored_blocks: int = 0
    # Pages that two or more held vLLM blocks map to (each keeps the page visible).
    shared_pages: int = 0
    # Blocks stored by a release that publishes no extra keys (vLLM < 0.17), mirrored as if
    # they had none (see `require_extra_keys`).
    unkeyed_blocks: int = 0
    # Fields the events carry that do not change what a block holds, by name (ownership,
    # session_id, kv_cache_spec_kind, kv_cache_spec_sliding_window), and fields the decoder
    # does not know, by name.
    ignored_fields: Counter = field(default_factory=Counter)
    unknown_fields: Counter = field(default_factory=Counter)


_TOKEN_MIN, _TOKEN_MAX = -(1 << 31), (1 << 31) - 1  # what kvcm.hashing.hash_page takes

_IGNORED_FIELDS = ("ownership", "session_id", "kv_cache_spec_kind",
                   "kv_cache_spec_sliding_window")


class EngineMirror:
    """Mirror of one engine's cache. Not thread-safe: one owner applies events and takes
    changes. `ns_key` is the namespace's 16-byte hash key.

    `lora_by_name`: hash a LoRA block's pages by its adapter name (or, before 0.14, its integer
    id), as vLLM before 0.31 does. vLLM >= 0.31 hashes ("lora", name, path) but publishes
    the name only, so by default LoRA blocks are refused (reason "lora"): a name reused for
    another adapter path would claim hits vLLM does not give.

    `require_extra_keys`: refuse blocks of releases that publish no extra keys (vLLM < 0.17,
    reason "no_extra_keys"): there a salted or multimodal block looks plain and its page
    would claim hits for the plain prompt. Off: they are mirrored and counted."""

    def __init__(self, ns_key: bytes, page_size: int, block_size: int, kv_group: int = 0,
                 lora_by_name: bool = False, require_extra_keys: bool = False,
                 verify_block: VerifyBlock | None = None):
        self.k = blocks_per_page(page_size, block_size)
        self.page_size = page_size
        self.block_size = block_size
        self.kv_group = kv_group
        self.lora_by_name = lora_by_name
        self.require_extra_keys = require_extra_keys
        self._verify = verify_block
        self._ns_key = ns_key
        self.counters = MirrorCounters()
        self._log_counts: Counter = Counter()
        self.reset()

    # ---- state ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forgets everything, emitting nothing (a new kvcm session follows)."""
        self._blocks: dict[BlockHash, _Block] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._holds: dict[Tier, dict[BlockHash, int]] = {t: {} for t in Tier}
        self._visible: dict[Tier, set[BlockHash]] = {t: set() for t in Tier}
        # Visible page-end blocks per kvcm page hash: a page leaves when its last one does.
        self._page_refs: dict[Tier, Counter] = {t: Counter() for t in Tier}
        self._unresolved: set[BlockHash] = set()
        self._changes: list[Change] = []
        # Touched by the batch being applied: pages to re-evaluate, blocks maybe unheld.
        self._dirty: dict[Tier, set[BlockHash]] = {t: set() for t in Tier}
        self._released: set[BlockHash] = set()

    def rekey(self, ns_key: bytes) -> None:
        """Rehashes every block with a new namespace key (the manager's secret changed).
        Emits nothing: send snapshot() in a new session."""
        self._ns_key = ns_key
        roots = []
        for h, b in self._blocks.items():
            b.depth, b.khash, b.acc_tokens, b.acc_extras = -1, None, (), ()
            self._unresolved.add(h)
            if b.parent is None:
                roots.append(h)
        for t in Tier:
            self._visible[t].clear()
            self._page_refs[t].clear()
        for h in roots:
            self._resolve(h)
        for t in Tier:
            for h in roots:
                self._refresh(t, h)
        self._changes.clear()

    @property
    def ns_key(self) -> bytes:
        return self._ns_key

    def take_changes(self) -> list[Change]:
        """Changes since the last call, in order."""
        out, self._changes = self._changes, []
        return out

    def snapshot(self) -> list[Change]:
        """STORED for every visible chain (one per visible page with no visible child page)."""
        out = []
        for t in Tier:
            vis = self._visible[t]
            for e in vis:
                if not any(c in vis for c in self._next_page_ends(e)):
                    out.append(Change(ChangeKind.STORED, t, self._chain(e)))
        return out

    def visible_pages(self, tier: Tier) -> set[bytes]:
        """kvcm hashes of the pages visible in a tier."""
        return {self._blocks[e].khash for e in self._visible[tier]}  # type: ignore[misc]

    def held_blocks(self, tier: Tier) -> int:
        return len(self._holds[tier])

    @property
    def orphans(self) -> int:
        """Held or known blocks whose chain to a prompt start is unknown (no kvcm hash)."""
        contentless = sum(1 for t in Tier for h in self._holds[t] if h not in self._blocks)
        return len(self._unresolved) + contentless

    @property
    def known_blocks(self) -> int:
        return len(self._blocks)

    # ---- events -----------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        """Applies one decoded event; refusals are counted, never raised."""
        self.apply_batch((event,))

    def apply_batch(self, events: Iterable[Event]) -> None:
        """Applies the events of one vLLM batch (one engine step). What they change is
        worked out once, at the end, so blocks stored or evicted together give one STORED or
        REMOVED per chain rather than one per block."""
        for event in events:
            self.counters.events[type(event).__name__] += 1
            if not isinstance(event, AllBlocksCleared):
                self._count_fields(event)
            if isinstance(event, AllBlocksCleared):
                for t in Tier:
                    if self._visible[t]:
                        self._changes.append(Change(ChangeKind.CLEARED, t))
                changes = self._changes
                self.reset()
                self._changes = changes
                continue
            if event.group_idx is not None and event.group_idx != self.kv_group:
                self.counters.ignored_events["other_group"] += 1
                continue
            if event.locality is not None and event.locality.upper() == "REMOTE":
                self.counters.ignored_events["remote"] += 1
                continue
            tier = tier_of_medium(event.medium)
            if tier is None:
                self._refuse("unknown_medium", len(event.block_hashes),
                             f"medium {event.medium!r} is not a tier kvcm knows")
            elif isinstance(event, BlockStored):
                self._stored(event, tier)
            elif isinstance(event, BlockRemoved):
                self._removed(event, tier)
        self._flush()

    def _flush(self) -> None:
        """Re-evaluates the pages of the blocks the batch touched, shallowest first (a page
        that appears or goes takes its subtree with it), then forgets unheld blocks."""
        for t in Tier:
            dirty = self._dirty[t]
            if not dirty:
                continue
            blocks = [(b.depth, h) for h in dirty
                      if (b := self._blocks.get(h)) is not None and b.depth >= 0]
            dirty.clear()
            for _, h in sorted(blocks, key=lambda x: x[0]):
                self._refresh(t, h)
        for h in self._released:
            if not any(h in self._holds[t] for t in Tier):
                self._forget(h)
        self._released.clear()

    def _count_fields(self, event: BlockStored | BlockRemoved) -> None:
        for name in _IGNORED_FIELDS:
            if getattr(event, name, None) is not None:
                self.counters.ignored_fields[name] += 1
        for name in event.unknown_fields:
            self.counters.unknown_fields[name] += 1

    def _refuse(self, reason: str, blocks: int, message: str) -> None:
        self.counters.refused_blocks[reason] += blocks
        n = self._log_counts[reason]
        self._log_counts[reason] += 1
        if n < 10 or n % 1000 == 0:
            log.warning("refused %d block(s): %s (%s, seen %d times)", blocks, message, reason,
                        n + 1)

    def _stored(self, ev: BlockStored, tier: Tier) -> None:
        n, bs = len(ev.block_hashes), self.block_size
        resolved: list[BlockHash] = []
        if ev.refused:
            self._refuse(ev.refused, n, f"the decoder refused these blocks ({ev.refused})")
            return
        if ev.lookahead_token_ids is not None and any(ev.lookahead_token_ids):
            # vLLM's hash covers tokens after the block, kvcm's page hash does not: the
            # page would claim hits for prompts that continue differently.
            self._refuse("lookahead", n, "block hashes cover lookahead tokens "
                         "(speculative decoding with prefix caching)")
            return
        if not self.lora_by_name and (ev.lora_name or ev.lora_id is not None):
            self._refuse("lora", n, f"LoRA block ({ev.lora_name or ev.lora_id}): vLLM hashes "
                         "the adapter path, which events do not carry")
            return
        if not ev.keys_published and ev.token_ids:
            if self.require_extra_keys:
                self._refuse("no_extra_keys", n, "the release publishes no extra keys (vLLM "
                             "< 0.17): salted blocks cannot be told apart")
                return
            self.counters.unkeyed_blocks += n
        if ev.token_ids:
            if ev.block_size != bs:
                self._refuse("block_size", n, f"event block_size {ev.block_size} is not the "
                             f"configured engine block size {bs}")
                return
            if len(ev.token_ids) != n * bs:
                self._refuse("token_count", n, f"{len(ev.token_ids)} token ids for {n} blocks "
                             f"of {bs}")
                return
            if min(ev.token_ids) < _TOKEN_MIN or max(ev.token_ids) > _TOKEN_MAX:
                self._refuse("token_range", n, "token ids outside int32, the range of kvcm "
                             "page hashes (SGLang hashes ids up to 2^63 - 1)")
                return
            extras = [self._extras_of(ev, i) for i in range(n)]
            try:
                canonical_extras(extras)
            except ValueError as e:
                self._refuse("extra_keys", n, f"extra keys kvcm cannot encode: {e}")
                return
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                self._add_content(h, parent, ev.token_ids[i * bs:(i + 1) * bs], extras[i],
                                  resolved)
                parent = h
        for t in Tier:  # a block whose chain became known may be held in any tier
            self._dirty[t].update(resolved)
        held = self._holds[tier]
        for h in ev.block_hashes:
            if h in held:
                self.counters.restored_blocks += 1
            held[h] = 1
        self._dirty[tier].update(ev.block_hashes)
        self.counters.blocks_stored += n

    def _removed(self, ev: BlockRemoved, tier: Tier) -> None:
        held = self._holds[tier]
        for i, h in enumerate(ev.block_hashes):
            count = held.get(h, 0)
            if count == 0:
                self.counters.unknown_removals += 1
                continue
            left = ev.remaining_copy_counts[i] if ev.remaining_copy_counts else count - 1
            if left > 0:
                held[h] = left
            else:
                del held[h]
                self._dirty[tier].add(h)
                self._released.add(h)
            self.counters.blocks_removed += 1

    @staticmethod
    def _extras_of(ev: BlockStored, i: int) -> BlockExtras:
        """What vLLM mixed into block i's hash, as far as the event says: its extra_keys, or
        (releases without them) the LoRA name, else the integer LoRA id."""
        if ev.extra_keys is not None:
            return normalize_extras(ev.extra_keys[i])
        if ev.lora_name:
            return (ev.lora_name,)
        if ev.lora_id is not None:
            return (ev.lora_id,)
        return None

    # ---- content and hashes -----------------------------------------------------------

    def _add_content(self, h: BlockHash, parent: BlockHash | None, tokens: tuple[int, ...],
                     extras: BlockExtras, resolved: list[BlockHash]) -> None:
        b = self._blocks.get(h)
        if b is not None:
            if b.tokens != tokens or b.parent != parent or b.extras != extras:
                self.counters.conflicts += 1
            return
        self._blocks[h] = _Block(parent, tokens, extras)
        if parent is not None:
            self._children.setdefault(parent, set()).add(h)
        self._unresolved.add(h)
        if self._resolve(h):
            resolved.append(h)

    def _forget(self, h: BlockHash) -> None:
        """Drops a block no tier holds; its children keep their derived hashes."""
        b = self._blocks.pop(h, None)
        if b is None:
            return
        self._unresolved.discard(h)
        if b.parent is not None:
            sib = self._children.get(b.parent)
            if sib is not None:
                sib.discard(h)
                if not sib:
                    del self._children[b.parent]

    def _resolve(self, h: BlockHash) -> bool:
        """Derives the kvcm hashes of h and of its orphaned descendants, when h's chain is
        known. Returns whether h was resolved."""
        resolved_any = False
        stack = [h]
        k = self.k
        while stack:
            x = stack.pop()
            b = self._blocks[x]
            p = None if b.parent is None else self._blocks.get(b.parent)
            if b.parent is not None and (p is None or p.depth < 0):
                continue
            if self._verify is not None:
                b.state = self._verify(None if p is None else p.state, b.tokens, b.extras, x)
                if b.state is None:  # stays an orphan, and so does everything under it
                    self._refuse("hash_mismatch", 1, "the block's published hash is not the "
                                 "engine's hash of its content (content the event does not "
                                 "carry went into it)")
                    continue
            if p is None:
                b.depth, b.page_prev = 0, hashing.ZERO_HASH
                b.acc_tokens, b.acc_extras = b.tokens, (b.extras,)
            else:
                b.depth = p.depth + 1
                if b.depth % k == 0:
                    assert p.khash is not None  # the parent ends the previous page
                    b.page_prev, b.acc_tokens, b.acc_extras = p.khash, b.tokens, (b.extras,)
                else:
                    b.page_prev = p.page_prev
                    b.acc_tokens = p.acc_tokens + b.tokens
                    b.acc_extras = p.acc_extras + (b.extras,)
            if b.depth % k == k - 1:
                b.khash = page_hash(self._ns_key, b.page_prev, b.acc_tokens, b.acc_extras)
                if k > 1:
                    b.acc_tokens, b.acc_extras = (), ()
            self._unresolved.discard(x)
            resolved_any = resolved_any or x == h
            for c in self._children.get(x, ()):
                if self._blocks[c].depth < 0:
                    stack.append(c)
        return resolved_any

    # ---- visibility -------------------------------------------------------------------

    def _page_ends_under(self, h: BlockHash, levels: int) -> list[BlockHash]:
        """Resolved descendants of h exactly `levels` blocks below it (h itself for 0)."""
        frontier = [h]
        for _ in range(levels):
            frontier = [c for x in frontier for c in self._children.get(x, ())
                        if self._blocks[c].depth >= 0]
        return frontier

    def _next_page_ends(self, e: BlockHash) -> list[BlockHash]:
        return self._page_ends_under(e, self.k)

    def _should_be_visible(self, t: Tier, e: BlockHash) -> bool:
        held = self._holds[t]
        x: BlockHash | None = e
        for _ in range(self.k):
            if x is None or x not in held:
                return False
            x = self._blocks[x].parent
        if self._blocks[e].depth < self.k:
            return True
        return x in self._visible[t]

    def _refresh(self, t: Tier, h: BlockHash) -> None:
        """Re-evaluates the pages containing resolved block h in tier t, and below them the
        pages whose visibility follows; emits the changes."""
        b = self._blocks[h]
        vis = self._visible[t]
        refs = self._page_refs[t]
        newly: list[BlockHash] = []
        stack = self._page_ends_under(h, self.k - 1 - b.depth % self.k)
        while stack:
            e = stack.pop()
            was, now = e in vis, self._should_be_visible(t, e)
            if now and not was:
                vis.add(e)
                khash = self._blocks[e].khash
                refs[khash] += 1
                if refs[khash] == 2:
                    self.counters.shared_pages += 1
                newly.append(e)
                stack.extend(self._next_page_ends(e))
            elif was and not now:
                self._hide_subtree(t, e)
        for e in newly:
            if e in vis and not any(c in vis for c in self._next_page_ends(e)):
                self._changes.append(Change(ChangeKind.STORED, t, self._chain(e)))

    def _hide_subtree(self, t: Tier, e: BlockHash) -> None:
        """Hides page-end e and the visible pages under it. A page another visible block
        still maps to stays (no REMOVED); REMOVED goes out for each topmost page that left,
        the manager dropping what is under it."""
        vis, refs = self._visible[t], self._page_refs[t]
        stack = [e]
        while stack:
            x = stack.pop()
            vis.discard(x)
            b = self._blocks[x]
            refs[b.khash] -= 1
            if refs[b.khash] <= 0:
                del refs[b.khash]
                if x == e or b.page_prev in refs:
                    self._changes.append(Change(ChangeKind.REMOVED, t, self._chain(x)))
            stack.extend(c for c in self._next_page_ends(x) if c in vis)

    def _chain(self, e: BlockHash) -> bytes:
        """kvcm hashes of the pages from page 0 to the page ending at block e."""
        out = []
        x: BlockHash | None = e
        while x is not None:
            b = self._blocks[x]
            out.append(b.khash)
            for _ in range(self.k):
                x = self._blocks[x].parent if x is not None else None
        out.reverse()
        return b"".join(out)  # type: ignore[arg-type]
