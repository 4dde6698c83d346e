"""What kvcm's vLLM connector reads from vLLM's configuration and KV tensors, before it
moves a byte: kv_connector_extra_config (ConnectorOptions), the shapes it refuses
(unsupported_reason, unsupported_kv_cache), the namespace spec (model_spec_of), the page
sets of a tensor-parallel engine (shards_of). The byte layout of a block is layout.py's.
See docs/CONNECTOR.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from vllm.logger import init_logger

import kvcm
from kvcm import _cli

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under "vllm." so that vLLM's logging configuration shows it.
logger = init_logger("vllm.kvcm_connector")

_DTYPES = {torch.bfloat16: kvcm.KvDtype.BF16, torch.float16: kvcm.KvDtype.FP16}
MAX_BLOCKS_PER_CALL = 64  # the agent's default max_blocks_per_call
HOST_TIER = int(kvcm.Tier.HOST)
# Where vLLM's KV may live: host memory, or a CUDA device (staged through pinned memory).
SUPPORTED_DEVICES = ("cpu", "cuda")
# Deprecated kv_connector_extra_config keys -> their names (issue 26's vocabulary).
EXTRA_CONFIG_ALIASES = {"ca_file": "tls_ca_file", "cert_file": "tls_cert_file",
                        "key_file": "tls_key_file", "manager": "manager_address",
                        "agent": "agent_address"}


@dataclass
class ConnectorOptions:
    """kv_connector_extra_config. Addresses are host:port; plaintext only in this slice."""

    manager_address: str
    # The agent each tensor-parallel rank uses: one value for all ranks, or a list with one
    # per rank (as local_socket); see shards_of.
    agent_id: Any
    agent_address: Any
    tenant: str = "default"
    model: str = ""  # default: vLLM's served model name
    lease_ttl_ms: int = 60_000  # of a load's pin; request_finished releases it sooner
    # Bound on each manager call on a request's path (Route, a producer's Insert): past it
    # the call fails and the request computes its prefill (a miss) or stores nothing, rather
    # than waiting out a manager takeover under the client's default deadline.
    request_deadline_ms: int = 500
    # Bound on each call to the local agent inside vLLM's model step (Stats, Fetch, a load's
    # reads, a store's Allocate and writes): past it the load recomputes and the store is
    # skipped, rather than holding every running request's step.
    agent_deadline_ms: int = 5_000
    # What recomputing a token costs on this engine (Route's cost model for fetches);
    # 0: the manager's route_prefill_tokens_per_s.
    prefill_tokens_per_s: float = 0.0
    # Fetch pages other agents hold when the cost model says so (False: local pages only).
    fetch: bool = True
    # TLS to the manager and the agent (tls_ca_file; tls_cert_file + tls_key_file: mutual
    # TLS) and the bearer token (token_file, else $KVCM_TOKEN); no tls_ca_file: plaintext.
    # The keys ca_file, cert_file, key_file are deprecated aliases (a warning is logged).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    # The agent's --local_socket: the engine registers its KV memory with the agent
    # (kvcm.agent_local), which copies blocks in and out with one memcpy. Empty: bytes go
    # over BlockAgent's ReadBlocks / WriteBlocks.
    local_socket: Any = ""
    # For failure tests only: before reading a load's blocks (after fetching them), wait
    # until this file exists (at most 60 s), so a test can break things mid-load.
    test_load_gate: str = ""
    # kv_both: copy a step's stores to the agent on a background thread while vLLM samples
    # and schedules, joined before the next forward (ConnectorWorker.wait_for_save). False:
    # in the step, as kv_producer always does.
    background_stores: bool = True
    # For tests only: move a CPU cache's bytes through the host staging buffer a CUDA cache
    # uses (layout.KvBlocks), so CPU engines run that path.
    test_stage: bool = False

    @classmethod
    def from_extra(cls, extra: Dict[str, Any], served_model: str) -> "ConnectorOptions":
        extra = _cli.rename_keys(extra, EXTRA_CONFIG_ALIASES, "KvcmConnector",
                                 "kv_connector_extra_config", warn=logger.warning)
        missing = [k for k in ("manager_address", "agent_id", "agent_address") if not extra.get(k)]
        if missing:
            raise ValueError(f"KvcmConnector: kv_connector_extra_config lacks {missing}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"KvcmConnector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(known)})")
        return cls(
            manager_address=str(extra["manager_address"]),
            agent_id=_str_or_list(extra["agent_id"]),
            agent_address=_str_or_list(extra["agent_address"]),
            tenant=str(extra.get("tenant", "default")),
            model=str(extra.get("model") or served_model),
            lease_ttl_ms=int(extra.get("lease_ttl_ms", 60_000)),
            request_deadline_ms=int(extra.get("request_deadline_ms", 500)),
            agent_deadline_ms=int(extra.get("agent_deadline_ms", 5_000)),
            prefill_tokens_per_s=float(extra.get("prefill_tokens_per_s", 0.0)),
            fetch=bool(extra.get("fetch", True)),
            tls_ca_file=str(extra.get("tls_ca_file", "")),
            tls_cert_file=str(extra.get("tls_cert_file", "")),
            tls_key_file=str(extra.get("tls_key_file", "")),
            token_file=str(extra.get("token_file", "")),
            local_socket=_str_or_list(extra.get("local_socket", "")),
            test_load_gate=str(extra.get("test_load_gate", "")),
            background_stores=bool(extra.get("background_stores", True)),
            test_stage=bool(extra.get("test_stage", False)),
        )


def _str_or_list(value: Any) -> Any:
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)


def _per_rank(opts: ConnectorOptions, key: str, tp: int) -> List[str]:
    value = getattr(opts, key)
    values = list(value) if isinstance(value, list) else [value]
    if len(values) not in (1, tp):
        raise ValueError(f"KvcmConnector: kv_connector_extra_config {key} has {len(values)} "
                         f"values: give one (for every rank) or one per tensor-parallel rank "
                         f"({tp})")
    return values if len(values) == tp else values * tp


def shards_of(opts: ConnectorOptions, vllm_config: "VllmConfig") -> List[Shard]:
    """The page sets of this engine. MLA: one, in namespace (tenant, model), stored by rank
    0 into rank 0's agent and read by every rank from it (the latent is the same on every
    rank). MHA/GQA with tensor parallelism: one per rank, in namespace (tenant,
    "<model>/tp<N>-rank<r>"), each stored into and read from that rank's agent, so a rank
    can only load its own KV heads. One rank: one, in (tenant, model)."""
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    ids, addresses, sockets = (_per_rank(opts, k, tp)
                               for k in ("agent_id", "agent_address", "local_socket"))
    if getattr(vllm_config.model_config, "use_mla", False) or tp == 1:
        return [Shard(kvcm.Namespace(opts.tenant, opts.model), ids[0], addresses[0],
                      sockets[0])]
    return [Shard(kvcm.Namespace(opts.tenant, f"{opts.model}/tp{tp}-rank{r}"), ids[r],
                  addresses[r], sockets[r]) for r in range(tp)]


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's parallel state is up when the worker's
    connector is made)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def unsupported_reason(vllm_config: "VllmConfig") -> Optional[str]:
    """Why this connector must not run with `vllm_config`, or None. Shapes it would get wrong
    without an error are refused before anything is registered (never wrong bytes):
    pipeline or decode-context parallelism (a rank holds only some layers or some tokens of
    a page), and KV caches on devices other than the CPU and CUDA. MLA and
    tensor parallelism are handled: see shard_of."""
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    if pp > 1 or dcp > 1:
        return (f"KvcmConnector: pipeline_parallel_size {pp} / decode_context_parallel_size "
                f"{dcp} is not supported: a rank would hold only some layers or tokens of a "
                "page. Run with one pipeline stage (tensor and data parallelism are fine)")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if device not in SUPPORTED_DEVICES + (None,):
        return (f"KvcmConnector: a KV cache on device '{device}' is not supported: the "
                "connector copies KV between host memory and CPU or CUDA tensors only")
    return None


def load_failure_warning(kv_transfer_config: Any) -> Optional[str]:
    """A warning when vLLM would fail requests whose kvcm load fails (its default
    kv_load_failure_policy "fail"): any agent fault (a restart, a lost pin, an evicted
    block) then fails user requests instead of recomputing their prefix. None for
    "recompute"."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy in ("recompute", None):
        return None
    return (f"KvcmConnector: kv_load_failure_policy is \"{policy}\": a failed kvcm load (an "
            "agent restarted, a pin lost, a block evicted) fails the request instead of "
            "recomputing its prefix. Set \"kv_load_failure_policy\": \"recompute\" in "
            "--kv-transfer-config (README)")


def unsupported_kv_cache(kv_caches: List[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """Why the connector must not move these KV tensors, or None: tensors in host memory or
    on one CUDA device (staged through pinned host memory: layout.KvBlocks) only."""
    devices = {t.device for _, t in kv_caches}
    for name, t in kv_caches:
        if t.device.type not in SUPPORTED_DEVICES:
            return (f"KvcmConnector: KV layer {name} is on {t.device}: the connector copies KV "
                    "between host memory and CPU or CUDA tensors only (not supported)")
    if len(devices) > 1:
        return (f"KvcmConnector: KV layers on {len(devices)} devices "
                f"({', '.join(sorted(str(d) for d in devices))}): one worker's KV must be on "
                "one device")
    return None


def model_spec_of(vllm_config: "VllmConfig") -> kvcm.ModelSpec:
    """The namespace's model spec from vLLM's model and cache config: MLA (one latent of
    kv_lora_rank + rope per token and layer, the same on every tensor-parallel rank: the
    model's own head counts, as kvcm's catalogue writes them) or MHA/GQA (one rank's
    shard: its KV heads)."""
    mc = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None or vllm_config.cache_config.cache_dtype not in ("auto", None):
        raise ValueError(f"KvcmConnector: KV dtype {mc.dtype} / "
                         f"{vllm_config.cache_config.cache_dtype} not supported (bf16, fp16)")
    block_size = vllm_config.cache_config.block_size
    if getattr(mc, "use_mla", False):
        hf = mc.hf_text_config
        return kvcm.ModelSpec(
            attention=kvcm.AttentionKind.MLA,
            num_layers=mc.get_total_num_hidden_layers(),
            num_heads=int(hf.num_attention_heads),
            kv_lora_rank=int(hf.kv_lora_rank),
            rope_dim=int(hf.qk_rope_head_dim),
            qk_nope_head_dim=int(getattr(hf, "qk_nope_head_dim", 0) or 0),
            v_head_dim=int(getattr(hf, "v_head_dim", 0) or 0),
            dtype=dtype,
            page_size_tokens=block_size,
        )
    heads = mc.get_num_attention_heads(parallel)
    kv_heads = mc.get_num_kv_heads(parallel)
    return kvcm.ModelSpec(
        attention=kvcm.AttentionKind.MHA if heads == kv_heads else kvcm.AttentionKind.GQA,
        num_layers=mc.get_num_layers(parallel),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=mc.get_head_size(),
        dtype=dtype,
        page_size_tokens=block_size,
    )


@dataclass
class Shard:
    """A page set: the namespace its pages live in and the agent that stores them. One for
    MLA (the latent is the same on every rank) or a single rank; one per tensor-parallel
    rank for MHA/GQA (each rank holds its own KV heads)."""

    namespace: kvcm.Namespace
    agent_id: str
    agent_address: str
    local_socket: str


def register(client: kvcm.Client, ns: kvcm.Namespace, spec: kvcm.ModelSpec) -> None:
    """Creates or confirms the namespace (and caches its hash key in `client`); a namespace
    with another spec or byte layout refuses this engine at start, naming both."""
    try:
        client.register_model(ns, spec)
    except kvcm.KvcmError as e:
        client.close()
        raise ValueError(f"KvcmConnector: namespace {ns} refuses vLLM's layout {spec}: "
                         f"{e}") from e
