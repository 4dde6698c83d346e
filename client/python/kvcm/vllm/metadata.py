"""What kvcm's vLLM connector's scheduler half tells its worker half each step (vLLM
carries it as the step's KVConnectorMetadata): the loads and stores of each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class FetchRun:
    """Pages [first_page, first_page + len(source_blocks)) of a prompt, held by another
    agent's pool: pulled into the local agent before they are loaded."""

    source_agent_id: str
    source_tier: int
    first_page: int
    source_blocks: List[int]


@dataclass
class ShardLoad:
    """One shard's part of a load: its agent holds pages [0, len(local_blocks)) (block,
    tier each); `fetch` brings the rest."""

    page_hashes: List[bytes]  # pages [0, end), in the shard's namespace
    local_blocks: List[Tuple[int, int]]
    fetch: List[FetchRun]


@dataclass
class LoadSpec:
    """Load pages [first_page, end) of a request into vLLM blocks `vllm_blocks`; each
    worker reads its shard's pages (`shards[shard_of(rank)]`)."""

    req_id: str
    first_page: int
    shards: List[ShardLoad]
    vllm_blocks: List[int]  # pages [first_page, end)


@dataclass
class StoreSpec:
    """A request's whole pages [0, num_pages) are computed: the worker stores those the
    local agent does not hold yet. `known_blocks`: the local agent's (main pool) blocks of
    leading pages, as the scheduler's match found them."""

    req_id: str
    tokens: List[int]
    vllm_blocks: List[int]
    known_blocks: List[List[int]]  # per shard


@dataclass
class KvcmConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    stores: List[StoreSpec] = field(default_factory=list)
