"""Engine kinds: what the bridge needs to know of one engine's events, found by name.

An engine kind is its payload decoder and, where the engine's block hashes can be recomputed
from what its events carry, a check of each block's published hash. Everything else (frames,
sequencing, the mirror, sessions, metrics) is shared. Adding an engine whose publisher speaks
the vLLM-family ZMQ frames (kvcm.engines.wire) takes a package with a decoder that builds
kvcm.engines.events records and a `KIND`, plus one line in `_BUILT_IN` (docs/ENGINES.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcm.engines.events import BlockHash, EventBatch

# verify(parent_state, tokens, extras, published_hash) -> this block's state, or None when the
# published hash is not what the engine's hashing gives for that content. parent_state is
# None for a block at a prompt's start; states are opaque to the mirror.
VerifyBlock = Callable[[Any, tuple[int, ...], Any, BlockHash], Any]


@dataclass(frozen=True)
class EngineKind:
    name: str
    # One payload frame -> a batch; raises kvcm.engines.events.EventDecodeError only.
    decode_batch: Callable[[bytes], EventBatch]
    # None: published hashes are taken as opaque ids (vLLM's hash function is configurable).
    verify_block: VerifyBlock | None = None


# name -> module that defines KIND; imported on first use so an engine's decoder loads only
# where a bridge serves that engine.
_BUILT_IN = {"vllm": "kvcm.vllm.events", "sglang": "kvcm.sglang.events"}
_registered: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> None:
    """Makes `kind` available by name (an engine kind living outside kvcm)."""
    if kind.name in _BUILT_IN or kind.name in _registered:
        raise KeyError(f"engine kind {kind.name!r} already exists")
    _registered[kind.name] = kind


def names() -> list[str]:
    return sorted({*_BUILT_IN, *_registered})


def get(name: str) -> EngineKind:
    """The engine kind called `name`; KeyError naming the known ones otherwise."""
    if name in _registered:
        return _registered[name]
    if name not in _BUILT_IN:
        raise KeyError(f"unknown engine kind {name!r}; known: {', '.join(names())}")
    kind = importlib.import_module(_BUILT_IN[name]).KIND
    assert isinstance(kind, EngineKind) and kind.name == name
    return kind
