"""kvcm as a vLLM (0.32, V1) KV connector: vLLM stores the full blocks it computes into its
local kvcm-agent and loads a prefix the agent holds instead of recomputing it.

    --kv-transfer-config '{"kv_connector": "KvcmConnector",
        "kv_connector_module_path": "kvcm.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_address": "HOST:PORT", "agent_id": "gpu0",
            "agent_address": "HOST:PORT", "tenant": "t", "model": "m"}}'

Scheduler side: Match + pin (on the manager) the longest prefix of a new request's whole
pages held by the local agent, beyond vLLM's own hit; the pin lasts until request_finished.
Worker side: ReadBlocks the pinned agent blocks into vLLM's paged KV before the forward;
after it, Allocate + WriteBlocks the newly computed whole pages and Insert them. Bytes go
over gRPC (this slice); shared memory is a later one.

kv_role: "kv_both" loads and stores; "kv_producer" (a prefill engine) stores and never loads;
"kv_consumer" (a decode engine) loads and never stores.

Block bytes: one agent block holds one vLLM block of every layer, layer after layer, each as
vLLM's per-block slice of that layer's cache (CPU backend: [kv_heads, block_size,
2 * head_dim], K then V in the last dim). It must have the namespace's bytes_per_block.
Any failure loads nothing (0 external tokens) or reports the blocks through
get_block_ids_with_load_errors, so vLLM recomputes them; never wrong KV.

Runs inside vLLM's processes: imports kvcm (grpcio + protobuf of vLLM's environment) and
torch; no other dependency.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

import kvcm
from kvcm._proto.v1 import agent_pb2, agent_pb2_grpc
from kvcm.types import PENDING_BLOCK_ID

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration shows it.
logger = init_logger("vllm.kvcm_connector")

_DTYPES = {torch.bfloat16: kvcm.KvDtype.BF16, torch.float16: kvcm.KvDtype.FP16}
_MAX_BLOCKS_PER_CALL = 64  # the agent's default max_blocks_per_call
_RPC_TIMEOUT_S = 10.0


@dataclass
class ConnectorOptions:
    """kv_connector_extra_config. Addresses are host:port; plaintext only in this slice."""

    manager_address: str
    agent_id: str
    agent_address: str
    tenant: str = "default"
    model: str = ""  # default: vLLM's served model name
    lease_ttl_ms: int = 60_000  # of a load's pin; request_finished releases it sooner

    @classmethod
    def from_extra(cls, extra: Dict[str, Any], served_model: str) -> "ConnectorOptions":
        missing = [k for k in ("manager_address", "agent_id", "agent_address") if not extra.get(k)]
        if missing:
            raise ValueError(f"KvcmConnector: kv_connector_extra_config lacks {missing}")
        return cls(
            manager_address=str(extra["manager_address"]),
            agent_id=str(extra["agent_id"]),
            agent_address=str(extra["agent_address"]),
            tenant=str(extra.get("tenant", "default")),
            model=str(extra.get("model") or served_model),
            lease_ttl_ms=int(extra.get("lease_ttl_ms", 60_000)),
        )


def model_spec_of(vllm_config: "VllmConfig") -> kvcm.ModelSpec:
    """The namespace's model spec from vLLM's model and cache config (GQA/MHA only)."""
    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None or vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"KvcmConnector: KV dtype {mc.dtype} / "
                         f"{vllm_config.cache_config.cache_dtype} not supported (bf16, fp16)")
    heads = mc.get_num_attention_heads(parallel)
    kv_heads = mc.get_num_kv_heads(parallel)
    return kvcm.ModelSpec(
        attention=kvcm.AttentionKind.MHA if heads == kv_heads else kvcm.AttentionKind.GQA,
        num_layers=mc.get_num_layers(parallel),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=mc.get_head_size(),
        dtype=dtype,
        page_size_tokens=vllm_config.cache_config.block_size,
    )


@dataclass
class LoadSpec:
    """Pages [first_page, first_page + len(agent_blocks)) of a request: agent block ids to
    read into vLLM block ids."""

    req_id: str
    agent_blocks: List[int]
    vllm_blocks: List[int]
    tier: int


@dataclass
class StoreSpec:
    """A request's whole pages [0, num_pages): its tokens, vLLM's block of each page, and the
    agent blocks of the leading pages the agent already holds (not written again)."""

    req_id: str
    tokens: List[int]
    vllm_blocks: List[int]
    present_agent_blocks: List[int]


@dataclass
class KvcmConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    stores: List[StoreSpec] = field(default_factory=list)


@dataclass
class _Matched:
    """Scheduler state of one request between its match and its first scheduling."""

    pin_id: int
    local_blocks: List[int]  # agent block of each leading page the local agent holds
    tier: int
    num_computed_tokens: int = 0
    num_external_tokens: int = 0
    stored: bool = False


class KvcmConnector(KVConnectorBase_V1):
    """One instance per role (scheduler, worker); vLLM calls each from one thread."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        served = vllm_config.model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0]
        self._opts = ConnectorOptions.from_extra(extra, str(served or "model"))
        self._block_size = vllm_config.cache_config.block_size
        self._loads = self._kv_transfer_config.is_kv_consumer  # kv_consumer, kv_both
        self._stores = self._kv_transfer_config.is_kv_producer  # kv_producer, kv_both
        self._spec = model_spec_of(vllm_config)
        self._ns = kvcm.Namespace(self._opts.tenant, self._opts.model)
        self._client = kvcm.Client(self._opts.manager_address, insecure=True)
        # Creates or confirms the namespace; a different spec under the same name refuses
        # to start (vLLM's KV would be read as another layout).
        try:
            self._client.register_model(self._ns, self._spec)
        except kvcm.KvcmError as e:
            self._client.close()
            raise ValueError(f"KvcmConnector: namespace {self._ns} refuses vLLM's layout "
                             f"{self._spec}: {e}") from e
        # Scheduler state.
        self._matched: Dict[str, _Matched] = {}
        # Worker state.
        self._kv_caches: List[Tuple[str, torch.Tensor]] = []
        self._load_errors: Set[int] = set()
        self._agent: Optional[agent_pb2_grpc.BlockAgentStub] = None
        self._channel: Optional[grpc.Channel] = None
        self._lock = threading.Lock()
        logger.info("KvcmConnector (%s, %s): namespace %s, agent %s at %s, spec %s",
                    role.name, self._kv_transfer_config.kv_role, self._ns, self._opts.agent_id,
                    self._opts.agent_address, self._spec)

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        self._release(request.request_id)
        tokens = list(request.prompt_token_ids or [])
        # At least one prompt token is always computed (vLLM needs its logits).
        loadable = (len(tokens) - 1) // self._block_size
        if loadable * self._block_size <= num_computed_tokens:
            return 0, False
        if not self._loads:  # kv_producer: store every whole page, match nothing
            self._matched[request.request_id] = _Matched(0, [], 0, num_computed_tokens)
            return 0, False
        try:
            match = self._client.match(
                self._ns, tokens[: loadable * self._block_size],
                requester_agent_id=self._opts.agent_id, pin=True,
                lease_ttl_ms=self._opts.lease_ttl_ms)
        except Exception as e:  # noqa: BLE001 - any failure: recompute
            logger.warning("KvcmConnector: match failed, recomputing: %s", e)
            return 0, False
        local: List[int] = []
        tier = 0
        for replicas in match.pages:
            mine = [r for r in replicas
                    if r.pool.agent_id == self._opts.agent_id and r.block_id != PENDING_BLOCK_ID]
            if not mine:
                break
            local.append(mine[0].block_id)
            tier = int(mine[0].pool.tier)
        self._matched[request.request_id] = _Matched(match.pin_id, local, tier,
                                                     num_computed_tokens)
        hit = len(local) * self._block_size
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        m = self._matched.get(request.request_id)
        if m is not None:
            m.num_external_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcmConnectorMetadata()
        bs = self._block_size
        for new_req in scheduler_output.scheduled_new_reqs:
            m = self._matched.get(new_req.req_id)
            if m is None or m.stored:
                continue
            block_ids = list(new_req.block_ids[0])
            if m.num_external_tokens > 0:
                first = m.num_computed_tokens // bs
                count = m.num_external_tokens // bs
                meta.loads.append(LoadSpec(new_req.req_id, m.local_blocks[first:first + count],
                                           block_ids[first:first + count], m.tier))
            tokens = list(new_req.prompt_token_ids or [])
            done = new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
                new_req.req_id, 0)
            # Whole prompt pages computed (or loaded) by the end of this step. A prompt whose
            # prefill spans several steps stores only this first step's pages (this slice).
            pages = min(done, len(tokens)) // bs
            if self._stores and pages > len(m.local_blocks):
                meta.stores.append(StoreSpec(new_req.req_id, tokens[: pages * bs],
                                             block_ids[:pages], list(m.local_blocks)))
            m.stored = True
        return meta

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._release(request.request_id)
        return False, None

    def _release(self, req_id: str) -> None:
        m = self._matched.pop(req_id, None)
        if m is None or m.pin_id == 0:
            return
        try:
            self._client.release(self._ns, m.pin_id)
        except Exception as e:  # noqa: BLE001 - the lease expires anyway
            logger.info("KvcmConnector: release of pin %d failed: %s", m.pin_id, e)

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        # Layer order = model order (vLLM's names end ".layers.<i>.self_attn.attn").
        def layer_index(name: str) -> Tuple[int, str]:
            digits = [p for p in name.split(".") if p.isdigit()]
            return (int(digits[0]) if digits else 0, name)

        self._kv_caches = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        per_block = sum(t[0].numel() * t.element_size() for _, t in self._kv_caches)
        expected = (self._spec.bytes_per_token_per_layer() * self._spec.num_layers
                    * self._block_size)
        logger.info("KvcmConnector: %d KV layers, layer 0 shape %s stride %s dtype %s; "
                    "%d bytes per block (namespace spec: %d)", len(self._kv_caches),
                    tuple(self._kv_caches[0][1].shape), self._kv_caches[0][1].stride(),
                    self._kv_caches[0][1].dtype, per_block, expected)
        if per_block != expected:
            raise ValueError(f"KvcmConnector: vLLM's KV block is {per_block} bytes, namespace "
                             f"{self._ns}'s spec {self._spec} makes {expected}")

    def _stub(self) -> agent_pb2_grpc.BlockAgentStub:
        if self._agent is None:
            self._channel = grpc.insecure_channel(
                self._opts.agent_address,
                options=[("grpc.max_receive_message_length", 64 << 20),
                         ("grpc.max_send_message_length", 64 << 20)])
            self._agent = agent_pb2_grpc.BlockAgentStub(self._channel)
        return self._agent

    def _epoch(self) -> int:
        return self._stub().Stats(agent_pb2.BlockAgentStatsRequest(), timeout=_RPC_TIMEOUT_S).epoch

    def _block_bytes(self, vllm_block: int) -> bytes:
        parts = [t[vllm_block].contiguous().view(torch.uint8).reshape(-1)
                 for _, t in self._kv_caches]
        return torch.cat(parts).numpy().tobytes()

    def _fill_block(self, vllm_block: int, data: memoryview) -> None:
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for _, t in self._kv_caches:
            dst = t[vllm_block]
            n = dst.numel() * dst.element_size()
            dst.copy_(src[offset:offset + n].view(t.dtype).view(dst.shape))
            offset += n

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        if not meta.loads:
            return
        try:
            epoch = self._epoch()
        except Exception as e:  # noqa: BLE001
            logger.warning("KvcmConnector: agent unreachable, recomputing: %s", e)
            for load in meta.loads:
                self._load_errors.update(load.vllm_blocks)
            return
        for load in meta.loads:
            try:
                self._load(load, epoch)
            except Exception as e:  # noqa: BLE001 - recompute those blocks
                logger.warning("KvcmConnector: load of %s failed, recomputing: %s",
                               load.req_id, e)
                self._load_errors.update(load.vllm_blocks)

    def _load(self, load: LoadSpec, epoch: int) -> None:
        block_bytes = self._expected_block_bytes()
        for i in range(0, len(load.agent_blocks), _MAX_BLOCKS_PER_CALL):
            agent_blocks = load.agent_blocks[i:i + _MAX_BLOCKS_PER_CALL]
            request = agent_pb2.ReadBlocksRequest(block_ids=agent_blocks, owner_epoch=epoch,
                                                  tier=load.tier)
            data = b"".join(r.data for r in self._stub().ReadBlocks(
                request, timeout=_RPC_TIMEOUT_S))
            if len(data) != block_bytes * len(agent_blocks):
                raise RuntimeError(f"ReadBlocks returned {len(data)} bytes for "
                                   f"{len(agent_blocks)} blocks of {block_bytes}")
            view = memoryview(data)
            for j, vllm_block in enumerate(load.vllm_blocks[i:i + len(agent_blocks)]):
                self._fill_block(vllm_block, view[j * block_bytes:(j + 1) * block_bytes])
        logger.info("KvcmConnector: loaded %d blocks of %s", len(load.agent_blocks), load.req_id)

    def _expected_block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for _, t in self._kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save stores whole blocks of every layer after the forward

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        for store in meta.stores:
            try:
                self._store(store)
            except Exception as e:  # noqa: BLE001 - a store that fails only costs a later hit
                logger.warning("KvcmConnector: store of %s failed: %s", store.req_id, e)

    def _store(self, store: StoreSpec) -> None:
        stub = self._stub()
        epoch = self._epoch()
        present = len(store.present_agent_blocks)
        new_vllm = store.vllm_blocks[present:]
        request = agent_pb2.AllocateBlocksRequest(count=len(new_vllm), owner_epoch=epoch)
        request.namespace.tenant, request.namespace.model = self._ns.tenant, self._ns.model
        allocated = stub.Allocate(request, timeout=_RPC_TIMEOUT_S)
        new_agent = list(allocated.block_ids)
        generations = list(allocated.block_generations)
        try:
            for i in range(0, len(new_agent), _MAX_BLOCKS_PER_CALL):
                ids = new_agent[i:i + _MAX_BLOCKS_PER_CALL]
                gens = generations[i:i + _MAX_BLOCKS_PER_CALL]
                payload = [self._block_bytes(b) for b in new_vllm[i:i + len(ids)]]

                def messages(ids=ids, gens=gens, payload=payload):
                    yield agent_pb2.WriteBlocksRequest(header=agent_pb2.WriteBlocksHeader(
                        block_ids=ids, owner_epoch=epoch, block_generations=gens))
                    for chunk in payload:
                        yield agent_pb2.WriteBlocksRequest(data=chunk)

                stub.WriteBlocks(messages(), timeout=_RPC_TIMEOUT_S)
            result = self._client.insert(self._ns, store.tokens, self._opts.agent_id,
                                         store.present_agent_blocks + new_agent,
                                         agent_epoch=epoch)
        except Exception:
            self._free(new_agent, generations, epoch)
            raise
        # Pages another request stored meanwhile: our copies of them are duplicates.
        dup = [(b, g) for k, (b, g) in enumerate(zip(new_agent, generations))
               if present + k < result.already_present_pages
               and (present + k >= len(result.existing_block_ids)
                    or result.existing_block_ids[present + k] != b)]
        if dup:
            self._free([b for b, _ in dup], [g for _, g in dup], epoch)
        logger.info("KvcmConnector: stored %d new pages of %s (%d already present)",
                    len(new_agent) - len(dup), store.req_id, present + len(dup))

    def _free(self, block_ids: List[int], generations: List[int], epoch: int) -> None:
        try:
            self._stub().Free(agent_pb2.FreeBlocksRequest(
                block_ids=block_ids, owner_epoch=epoch, block_generations=generations),
                timeout=_RPC_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            logger.info("KvcmConnector: free of %d blocks failed: %s", len(block_ids), e)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        return None, None

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._client.close()
