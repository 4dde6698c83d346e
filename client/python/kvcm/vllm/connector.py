"""kvcm as a vLLM (0.32, V1) KV connector: vLLM stores the full blocks it computes into its
local kvcm-agent and loads a prefix that any agent of the cluster holds instead of
recomputing it.

    --kv-transfer-config '{"kv_connector": "KvcmConnector",
        "kv_connector_module_path": "kvcm.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"manager_address": "HOST:PORT", "agent_id": "gpu0",
            "agent_address": "HOST:PORT", "tenant": "t", "model": "m"}}'

Scheduler side (get_num_new_matched_tokens): one Route call for the local agent ranks the
prompt's cached pages: those the local agent holds, then those other agents hold that the
manager's cost model says are cheaper to fetch than to recompute. Both are pinned (lease
`lease_ttl_ms`) until request_finished. vLLM is told those tokens beyond its own hit.
Worker side (start_load_kv): pages held elsewhere are first pulled into the local agent
(BlockAgent.Fetch: TCP or NCCL between agents; the agent indexes the new replica), then
every page is read into vLLM's paged KV with its page hash, so the agent refuses a block
that no longer holds the page (pin lost, block evicted and reused). After the forward
(wait_for_save) the whole pages computed this step are copied into newly allocated agent
blocks and inserted at the manager; kv_both inserts in the background (the copy is done
when wait_for_save returns, so vLLM may reuse its blocks), kv_producer before returning
(its answer means the KV is in kvcm: prefill/decode disaggregation).

Bytes: with `local_socket` (the agent's --local_socket, same host) the worker moves vLLM's
KV tensors into one memfd it registers with the agent (kvcm.agent_local), and the agent
copies blocks between its pool and vLLM's cache itself, one memcpy per layer segment, with
the checks of ReadBlocks / WriteBlocks; vLLM never maps the agent's pool. Without it, bytes
go over the agent's gRPC ReadBlocks / WriteBlocks.

Block bytes: one agent block holds one vLLM block of every layer, layer after layer, each
that layer's block in memory order (layout.block_views); the namespace records that byte
layout, so engines of different layouts never share pages. MLA (DeepSeek) caches
one latent per token and layer, the same on every tensor-parallel rank: one page set,
stored by rank 0. MHA/GQA at tensor parallelism N: one page set (namespace) per rank, so a
rank only ever loads its own KV heads (config.shards_of).
Any failure loads nothing (0 external tokens) or reports the blocks through
get_block_ids_with_load_errors, so vLLM recomputes them: never wrong KV.

The connector is two halves, as vLLM's own connectors are: ConnectorScheduler
(kvcm.vllm.scheduler) and ConnectorWorker (kvcm.vllm.worker), over kvcm.agent's
AgentSession (the data path the SGLang backend shares).

Requests with a cache_salt, LoRA or multimodal inputs are served without kvcm: their KV
depends on more than the token ids a page hash covers.

Runs inside vLLM's processes: imports kvcm (grpcio + protobuf of vLLM's environment) and
torch; no other dependency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvcm
from kvcm.vllm.config import (  # noqa: F401 - re-exported: the connector's public surface
    EXTRA_CONFIG_ALIASES,
    ConnectorOptions,
    Shard,
    load_failure_warning,
    logger,
    model_spec_of,
    register,
    shards_of,
    unsupported_kv_cache,
    unsupported_reason,
)
from kvcm.vllm.layout import block_views  # noqa: F401 - re-exported
from kvcm.vllm.metadata import KvcmConnectorMetadata
from kvcm.vllm.scheduler import ConnectorScheduler
from kvcm.vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvcmConnector(KVConnectorBase_V1):
    """One instance per role: the scheduler's (ConnectorScheduler) or a worker's
    (ConnectorWorker); vLLM calls each from one thread."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        served = vllm_config.model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0]
        opts = ConnectorOptions.from_extra(extra, str(served or "model"))
        # Refused before any namespace is registered: a wrong spec would outlive this engine.
        if (reason := unsupported_reason(vllm_config)) is not None:
            raise ValueError(reason)
        spec = model_spec_of(vllm_config)
        kv = self._kv_transfer_config
        if kv.is_kv_consumer and (warning := load_failure_warning(kv)) is not None:
            logger.warning("%s", warning)
        shards = shards_of(opts, vllm_config)
        self._client = kvcm.Client(opts.manager_address, insecure=not opts.tls_ca_file,
                                   tls_ca_file=opts.tls_ca_file or None,
                                   tls_cert_file=opts.tls_cert_file or None,
                                   tls_key_file=opts.tls_key_file or None,
                                   token_file=opts.token_file or None)
        self._scheduler: Optional[ConnectorScheduler] = None
        self._worker: Optional[ConnectorWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler matches every page set; it moves no bytes, so it registers
            # with no byte layout (which every layout is compatible with).
            for shard in shards:
                register(self._client, shard.namespace, spec)
            self._scheduler = ConnectorScheduler(opts, self._client, shards,
                                                 vllm_config.cache_config.block_size,
                                                 bool(kv.is_kv_consumer),
                                                 bool(kv.is_kv_producer))
            logger.info("KvcmConnector (SCHEDULER, %s): page sets %s, spec %s", kv.kv_role,
                        ", ".join(f"{s.namespace} on {s.agent_id}" for s in shards), spec)
        else:
            # A worker registers its own page set once its KV tensors passed the layout
            # check (register_kv_caches).
            self._worker = ConnectorWorker(opts, self._client, spec, shards, vllm_config,
                                           kv_cache_config, bool(kv.is_kv_consumer))
            logger.info("KvcmConnector (WORKER, %s): %s", kv.kv_role, self._worker)

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save stores whole blocks of every layer after the forward

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcmConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        if self._worker is not None:
            self._worker.get_finished(finished_req_ids)
        return None, None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self._client.close()
