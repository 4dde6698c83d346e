"""A vLLM KV block as bytes: which bytes make block b of every layer and in what order
(block_views, whose layout string the namespace records), and moving runs of blocks between
vLLM's KV tensors and host bytes (KvBlocks), on the CPU or, staged through pinned host
memory, on a CUDA device.

vLLM 0.32 views every layer's KV as [blocks, heads, tokens, content] over one allocation
whose physical order is one of its KVCacheLayouts (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
BHLNC) and may split a block into kernel blocks (dim 0 then counts those). A block's bytes
here are its elements in memory order: the dims inside a block sorted by stride. Two
engines whose blocks list the same elements in the same order share pages whatever their
strides across blocks or layers (LBHNC and BLHNC do; LBHNC and LBNHC do not), and the
layout string says exactly that: backend, dtype, one block's logical shape and the memory
order of its dims."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# Bytes gathered from the device in one copy when a store streams blocks to the agent.
_GATHER_BYTES = 32 << 20


def _memory_order(t: torch.Tensor) -> List[int]:
    """The dims after dim 0 from the outermost in memory to the innermost. A dim of size 1
    has no place in memory (its stride means nothing) and keeps its logical position."""
    dims = list(range(1, t.dim()))
    ordered = iter(sorted((d for d in dims if t.shape[d] > 1), key=lambda d: (-t.stride(d), d)))
    return [d if t.shape[d] == 1 else next(ordered) for d in dims]


def block_views(kv_caches: List[Tuple[str, torch.Tensor]], num_blocks: int,
                backend: str) -> Tuple[List[Tuple[str, torch.Tensor]], str]:
    """Each layer's KV as a view whose dim 0 is vLLM's block (kernel blocks grouped) and
    whose other dims are in memory order, so that view[b], read in order, is block b's
    bytes in memory order; and the namespace's kv_layout string. ValueError, naming the
    layer, when a layer's dim 0 is not vLLM's blocks (or a multiple: kernel blocks) or when
    layers are laid out unlike each other."""
    views = []
    for name, t in kv_caches:
        if num_blocks and t.shape[0] != num_blocks:
            if t.dim() < 2 or t.shape[0] % num_blocks:
                raise ValueError(f"KvcmConnector: KV layer {name} has shape {tuple(t.shape)}: "
                                 f"its dim 0 is not vLLM's {num_blocks} blocks: not supported")
            t = t.unflatten(0, (num_blocks, -1))  # kernel blocks of one vLLM block
        order = _memory_order(t)
        # The tensor itself when already in memory order (the local path needs vLLM's own).
        physical = t if order == list(range(1, t.dim())) else t.permute(0, *order)
        views.append((name, t, order, physical))
    first_name, first, first_order, _ = views[0]
    for name, t, order, _ in views[1:]:
        if (t.shape[1:], order, t.dtype) != (first.shape[1:], first_order, first.dtype):
            raise ValueError(f"KvcmConnector: KV layer {name} (shape {tuple(t.shape)}, "
                             f"stride {t.stride()}) is laid out unlike {first_name} (shape "
                             f"{tuple(first.shape)}, stride {first.stride()}): not supported")
    dtype = _DTYPE_NAMES.get(first.dtype, str(first.dtype).replace("torch.", ""))
    shape = ",".join(str(d) for d in first.shape[1:])
    order = ",".join(str(d - 1) for d in first_order if first.shape[d] > 1)
    layout = f"vllm/{backend}:{dtype}:block[{shape}]:order[{order}]"
    return [(name, physical) for name, _, _, physical in views], layout


class KvBlocks:
    """Runs of vLLM blocks as bytes: gather (one block = every layer's block_views bytes,
    end to end) and scatter. One device copy per layer and run; a CUDA cache goes through
    a pinned host buffer, copied on the caller's current stream (so a gather follows the
    kernels that wrote the KV, and the forward after a scatter reads what it wrote).
    `stage` forces that staging path on a CPU cache (tests)."""

    def __init__(self, views: Sequence[torch.Tensor], *, stage: bool = False):
        self._views = list(views)
        self.device = self._views[0].device
        self._staged = stage or self.device.type != "cpu"
        self._layer_bytes = [v[0].numel() * v.element_size() for v in self._views]
        self.block_bytes = sum(self._layer_bytes)

    @property
    def staged(self) -> bool:
        return self._staged

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long, device=self.device)

    def _host(self, count: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty((count, self.block_bytes), dtype=torch.uint8, pin_memory=pin)

    def gather(self, blocks: Sequence[int]) -> torch.Tensor:
        """The bytes of `blocks` as a host uint8 tensor [len(blocks), block_bytes]."""
        index = self._index(blocks)
        parts = [v.index_select(0, index).reshape(len(blocks), -1).view(torch.uint8)
                 for v in self._views]
        joined = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if not self._staged:
            return joined
        host = self._host(len(blocks))
        host.copy_(joined)  # synchronous: done when it returns
        return host

    def scatter(self, blocks: Sequence[int], data: "bytes | bytearray | memoryview") -> None:
        """Writes len(blocks) x block_bytes of `data` into `blocks` (distinct)."""
        count = len(blocks)
        if len(data) != count * self.block_bytes:
            raise ValueError(f"scatter: {len(data)} bytes for {count} blocks of "
                             f"{self.block_bytes}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(count, self.block_bytes)
        if self._staged:
            host = self._host(count)
            host.copy_(src)
            src = host.to(self.device)  # synchronous from pinned memory
        index = self._index(blocks)
        at = 0
        for v, n in zip(self._views, self._layer_bytes):
            part = src[:, at:at + n].contiguous().view(v.dtype).view(count, *v.shape[1:])
            v.index_copy_(0, index, part)
            at += n


class BlockBytes:
    """vLLM blocks' bytes for AgentSession.write, indexed in order: gathered up to
    _GATHER_BYTES at a time, so one run's bytes are in host memory at once and a CUDA cache
    costs one device copy per chunk, not one per block."""

    def __init__(self, kv: KvBlocks, vllm_blocks: List[int]):
        self._kv, self._blocks = kv, vllm_blocks
        self._chunk = max(1, _GATHER_BYTES // max(1, kv.block_bytes))
        self._first, self._data = 0, None

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, i: int) -> memoryview:
        if self._data is None or not self._first <= i < self._first + len(self._data):
            self._first = i
            self._data = self._kv.gather(self._blocks[i:i + self._chunk]).numpy()
        return memoryview(self._data[i - self._first])
