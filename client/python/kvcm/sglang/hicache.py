"""kvcm as an SGLang (0.5.23) HiCache L3 storage backend: SGLang stores host-tier KV pages
into its local kvcm-agent and gets back pages any agent holds, through the manager's index.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcm",
        "module_path": "kvcm.sglang.hicache", "class_name": "KvcmHiCacheStorage",
        "manager_address": "HOST:PORT", "agent_id": "host0", "agent_address": "HOST:PORT",
        "tenant": "acme", "tls_ca_file": "ca.pem", "tls_cert_file": "client.pem",
        "tls_key_file": "client.key", "token_file": "acme.token"}'

Page identity: SGLang names a page by a string key, for its KV pool the SHA-256 chain of the
prefix's tokens up to and including the page (seeded by the request's extra_key/cache_salt),
so a key already stands for its whole prefix. Each key becomes a one-page kvcm prompt whose
page hash is SipHash128(key_ns, "kvcm/sglang/v1" || le32(len) || key): keyed by the
namespace, so another tenant (or model, layout, TP shard: see namespace_of) never derives
the same page, and domain-separated from kvcm's token pages. See docs/ENGINES.md.

Store (set, batch_set, batch_set_v1): pages the local pool holds already (a probe Match
each) are not stored again; for the others Allocate blocks on the local agent (in a full
pool the agent has the manager evict by its policy first), WriteBlocks, Insert each page
into the agent's pool (the manager commits the blocks through the agent's ledger); a page
another writer stored meanwhile frees the new copy. Get: Match with pin and lease;
a local replica is read with ReadBlocks (verified: the agent checks the block still holds
the page); a replica on another agent is first pulled into the local agent with
BlockAgent.Fetch (pinned source), then pinned again and read locally. Every pin is released
after its read. Exists: Match probe (changes nothing). The agent calls and the store
transaction are kvcm.agent.AgentSession's, shared with the vLLM connector.

TLS and tokens as the vLLM connector's (README "TLS and tokens"): tls_ca_file verifies the
manager and the agent, tls_cert_file + tls_key_file are the engine's client certificate
(mutual TLS), token_file (else $KVCM_TOKEN) its bearer token; plaintext only without
tls_ca_file. A manager or agent refusing the token fails the attach with a ValueError
saying so: SGLang then runs without its L3, nothing stored.

A page must have the namespace's bytes_per_page (its spec comes from SGLang's host pool:
MHA/GQA heads, or MLA's latent + rope width); any other size is refused, counted in
counters["refused_page_size"], and changes nothing. Safe to call from SGLang's prefetch and
backup threads at once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvcm
from kvcm import hashing
from kvcm.agent import AgentSession
from kvcm.types import PENDING_BLOCK_ID

logger = logging.getLogger(__name__)

PAGE_DOMAIN = b"kvcm/sglang/v1"
_DTYPES = {torch.bfloat16: kvcm.KvDtype.BF16, torch.float16: kvcm.KvDtype.FP16}
_TIERS = {"host": kvcm.Tier.HOST, "gpu": kvcm.Tier.GPU, "disk": kvcm.Tier.DISK}


def page_hash(ns_key: bytes, key: str) -> bytes:
    """The kvcm page hash (16 bytes) of SGLang page key `key` in the namespace keyed ns_key."""
    data = key.encode("utf-8")
    return hashing.siphash128(ns_key, PAGE_DOMAIN + len(data).to_bytes(4, "little") + data)


@dataclass
class HiCacheOptions:
    """The kvcm fields of --hicache-storage-backend-extra-config (SGLang's own fields,
    backend_name / module_path / class_name / interface_v1, are ignored here)."""

    manager_address: str
    agent_id: str
    agent_address: str
    tenant: str = "default"
    model: str = ""  # default: SGLang's model name
    tier: str = "host"  # the local agent's pool tier (its --tier)
    lease_ttl_ms: int = 30_000  # of the pin around each get
    rpc_timeout_s: float = 10.0
    # Bound on each manager call on a request's path (match, insert): past it the call fails
    # and the page is a miss / a store not made, rather than the request waiting out a
    # manager takeover under the client's default deadline (docs/OPERATIONS.md).
    request_deadline_ms: int = 500
    # TLS to the manager and the agent (tls_ca_file; tls_cert_file + tls_key_file: mutual
    # TLS) and the bearer token (token_file, else $KVCM_TOKEN); no tls_ca_file: plaintext.
    # The same keys as the vLLM connector's.
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""

    @classmethod
    def from_extra(cls, extra: Dict[str, Any], model_name: str) -> "HiCacheOptions":
        missing = [k for k in ("manager_address", "agent_id", "agent_address")
                   if not extra.get(k)]
        if missing:
            raise ValueError(f"KvcmHiCacheStorage: extra config lacks {missing}")
        tier = str(extra.get("tier", "host"))
        if tier not in _TIERS:
            raise ValueError(f"KvcmHiCacheStorage: tier {tier!r} is not one of {list(_TIERS)}")
        return cls(
            manager_address=str(extra["manager_address"]),
            agent_id=str(extra["agent_id"]),
            agent_address=str(extra["agent_address"]),
            tenant=str(extra.get("tenant") or "default"),
            model=str(extra.get("model") or model_name or "model"),
            tier=tier,
            lease_ttl_ms=int(extra.get("lease_ttl_ms", 30_000)),
            rpc_timeout_s=float(extra.get("rpc_timeout_s", 10.0)),
            request_deadline_ms=int(extra.get("request_deadline_ms", 500)),
            tls_ca_file=str(extra.get("tls_ca_file") or ""),
            tls_cert_file=str(extra.get("tls_cert_file") or ""),
            tls_key_file=str(extra.get("tls_key_file") or ""),
            token_file=str(extra.get("token_file") or ""),
        )


def model_spec_of(host_pool: Any) -> kvcm.ModelSpec:
    """The namespace's spec from SGLang's host KV pool (MHATokenToKVPoolHost or
    MLATokenToKVPoolHost): what one of its pages costs, per TP rank for MHA."""
    dtype = _DTYPES.get(host_pool.dtype)
    if dtype is None:
        raise ValueError(f"KvcmHiCacheStorage: KV dtype {host_pool.dtype} not supported "
                         "(bf16, fp16)")
    if hasattr(host_pool, "kv_lora_rank"):  # MLA: one latent + rope vector per token
        rope = host_pool.kv_cache_dim - host_pool.kv_lora_rank
        return kvcm.ModelSpec(attention=kvcm.AttentionKind.MLA,
                              num_layers=host_pool.layer_num, num_heads=1,
                              kv_lora_rank=host_pool.kv_lora_rank, rope_dim=rope,
                              dtype=dtype, page_size_tokens=host_pool.page_size)
    v_head_dim = getattr(host_pool, "v_head_dim", host_pool.head_dim)
    if v_head_dim != host_pool.head_dim:
        raise ValueError("KvcmHiCacheStorage: V head dim != K head dim is not supported")
    return kvcm.ModelSpec(attention=kvcm.AttentionKind.MHA, num_layers=host_pool.layer_num,
                          num_heads=host_pool.head_num, num_kv_heads=host_pool.head_num,
                          head_dim=host_pool.head_dim, dtype=dtype,
                          page_size_tokens=host_pool.page_size)


def namespace_of(opts: HiCacheOptions, config: HiCacheStorageConfig,
                 layout: str) -> kvcm.Namespace:
    """(tenant, model/sglang-LAYOUT[-tpR.S][-ppR.S][-cpR.S]): pages of one byte layout and
    one shard. MLA KV is replicated across TP ranks, so all of them share one namespace."""
    model = f"{opts.model}/sglang-{layout}"
    if not config.is_mla_model and config.tp_size > 1:
        model += f"-tp{config.tp_rank}.{config.tp_size}"
    if config.pp_size > 1:
        model += f"-pp{config.pp_rank}.{config.pp_size}"
    if config.attn_cp_size > 1:
        model += f"-cp{config.attn_cp_rank}.{config.attn_cp_size}"
    if config.dcp_size > 1:
        model += f"-dcp{config.dcp_rank}.{config.dcp_size}"
    return kvcm.Namespace(opts.tenant, model)


class KvcmHiCacheStorage(HiCacheStorage):
    """SGLang builds it with (storage_config, kwargs) and registers its host pool next;
    until then every call misses or refuses. Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self._config = storage_config
        self._opts = HiCacheOptions.from_extra(dict(storage_config.extra_config or {}),
                                               storage_config.model_name or "")
        self._pool = kvcm.PoolRef(self._opts.agent_id, _TIERS[self._opts.tier])
        o = self._opts
        self._client = kvcm.Client(o.manager_address, insecure=not o.tls_ca_file,
                                   tls_ca_file=o.tls_ca_file or None,
                                   tls_cert_file=o.tls_cert_file or None,
                                   tls_key_file=o.tls_key_file or None,
                                   token_file=o.token_file or None)
        # The local agent, with the client's TLS credentials and token.
        self.agent = AgentSession.of_client(self._client, o.agent_address,
                                            timeout_s=o.rpc_timeout_s)
        self._lock = threading.Lock()
        self._counters: Dict[str, int] = dict.fromkeys(
            ("stored_pages", "already_present_pages", "local_hits", "fetched_pages", "misses",
             "refused_page_size", "refused_unattached", "errors", "key_refreshes"), 0)
        self.ns: Optional[kvcm.Namespace] = None
        self.spec: Optional[kvcm.ModelSpec] = None
        self.bytes_per_page = 0
        self._ns_key = b""
        self._epoch = 0  # the local agent's, 0 until asked

    # ---- setup --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Derives the namespace and its spec from SGLang's host pool and registers it.
        Raises when the namespace has another spec or the agent's blocks another size:
        SGLang's pages would be misread, or never stored."""
        super().register_mem_pool_host(mem_pool_host)
        spec = model_spec_of(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        page_bytes = page.numel() * page.element_size()
        if page_bytes != spec.bytes_per_page():
            raise ValueError(f"KvcmHiCacheStorage: SGLang's page is {page_bytes} bytes, the "
                             f"spec {spec} makes {spec.bytes_per_page()}")
        ns = namespace_of(self._opts, self._config, str(mem_pool_host.layout))
        try:
            self._client.register_model(ns, spec)
        except (kvcm.Unauthenticated, kvcm.PermissionDenied) as e:
            raise ValueError(self._refused("manager", self._opts.manager_address, ns, e)) from e
        except kvcm.KvcmError as e:
            raise ValueError(f"KvcmHiCacheStorage: namespace {ns} refuses SGLang's layout "
                             f"{spec}: {e}") from e
        try:
            stats = self.agent.stats()
        except (kvcm.Unauthenticated, kvcm.PermissionDenied) as e:
            raise ValueError(self._refused("agent", self._opts.agent_address, ns, e)) from e
        except kvcm.KvcmError as e:
            raise ValueError(f"KvcmHiCacheStorage: agent {self._opts.agent_id} at "
                             f"{self._opts.agent_address} cannot be asked its geometry: "
                             f"{e}") from e
        if stats.geometry.bytes_per_block != page_bytes:
            raise ValueError(f"KvcmHiCacheStorage: agent {self._opts.agent_id}'s blocks are "
                             f"{stats.geometry.bytes_per_block} bytes, SGLang's pages "
                             f"{page_bytes}: start it with the model's geometry")
        self.ns, self.spec, self.bytes_per_page = ns, spec, page_bytes
        self._ns_key = self._client._require_key(ns).key
        logger.info("KvcmHiCacheStorage: namespace %s, %d bytes per page, agent %s at %s",
                    ns, page_bytes, self._opts.agent_id, self._opts.agent_address)

    def _refused(self, who: str, address: str, ns: kvcm.Namespace, e: kvcm.KvcmError) -> str:
        """Why the attach failed when the manager or the agent refused this engine's token."""
        token = (f"token_file {self._opts.token_file}" if self._opts.token_file else
                 "$KVCM_TOKEN" if self._client.options.token else "no token")
        return (f"KvcmHiCacheStorage: the {who} at {address} refused this engine's credentials "
                f"({token}) for namespace {ns}: {e}. Give token_file in "
                "--hicache-storage-backend-extra-config (or $KVCM_TOKEN) with a worker token "
                f"of tenant {ns.tenant} (README \"TLS and tokens\"); nothing is stored")

    def _agent_epoch(self) -> int:
        """The local agent's epoch, asked once and again after any failed call (a restarted
        agent has a new one, and none of the old blocks)."""
        if not self._epoch:
            self._epoch = self.agent.epoch()
        return self._epoch

    def _failed(self, what: str, e: Exception) -> None:
        """Counts a failed call; a stale namespace key (the manager's secret changed, or
        the namespace was deleted) is refreshed for the next call: this one stays failed."""
        logger.warning("KvcmHiCacheStorage: %s failed: %s", what, e)
        self._count("errors")
        self._epoch = 0
        if isinstance(e, kvcm.FailedPrecondition) and self.ns is not None:
            try:
                self._client.register_model(self.ns, self.spec)
                self._ns_key = self._client._require_key(self.ns).key
                self._count("key_refreshes")
            except kvcm.KvcmError as refresh:
                logger.warning("KvcmHiCacheStorage: re-registering %s failed: %s", self.ns,
                               refresh)

    @property
    def counters(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _hash(self, key: str) -> bytes:
        return page_hash(self._ns_key, key)

    def _page_bytes(self, value: Any) -> Optional[bytes]:
        """A page's bytes, or None (counted) unless it has exactly bytes_per_page."""
        if not isinstance(value, torch.Tensor):
            self._count("refused_page_size")
            return None
        raw = value.detach().contiguous().view(torch.uint8).reshape(-1)
        if raw.numel() != self.bytes_per_page:
            self._count("refused_page_size")
            return None
        return raw.numpy().tobytes()

    # ---- store --------------------------------------------------------------------------

    def _store(self, keys: Sequence[str], pages: Sequence[bytes]) -> List[bool]:
        """Stores the pages the local pool does not hold yet (a probe Match each): a block
        allocated for a page already held would be freed as a duplicate, and in a full pool
        its allocation would first have evicted another page."""
        ok = [False] * len(keys)
        new = []
        for i, key in enumerate(keys):
            match = self._match(self._hash(key), pin=False)
            if match.matched_pages and any(r.pool == self._pool for r in match.pages[0]):
                self._count("already_present_pages")
                ok[i] = True
            else:
                new.append(i)
        stored = self._store_new([keys[i] for i in new], [pages[i] for i in new])
        for i, done in zip(new, stored):
            ok[i] = done
        return ok

    def _store_new(self, keys: Sequence[str], pages: Sequence[bytes]) -> List[bool]:
        """Writes pages into new blocks of the local agent (one Allocate, WriteBlocks by the
        agent's max_blocks_per_call) and inserts each as its own one-page prompt; a page
        whose insert fails frees its block and is not stored."""
        if not keys:
            return []
        epoch = self._agent_epoch()
        staged = self.agent.stage(self.ns, pages, epoch=epoch)
        ok = [False] * len(keys)
        done = 0
        try:
            for i, key in enumerate(keys):
                h = self._hash(key)
                done = i + 1  # a failing commit frees block i itself
                try:
                    stored = self.agent.commit(self._client, staged.part(i, i + 1), self._pool,
                                               page_hashes=[h],
                                               deadline_ms=self._opts.request_deadline_ms)
                except kvcm.KvcmError as e:  # the page's block is freed
                    self._failed(f"insert of {key}", e)
                    continue
                ok[i] = True
                self._count("already_present_pages" if stored.duplicate_pages else
                            "stored_pages")
        except BaseException:
            # Blocks not inserted yet are still ours (inserted ones are the cache's).
            self.agent.free_staged(staged.part(done, len(keys)))
            raise
        return ok

    def _set_pages(self, keys: Sequence[str], values: Sequence[Any]) -> List[bool]:
        """Stores every page or, when one has the wrong size or nothing is attached, none."""
        if self.ns is None:
            self._count("refused_unattached", len(keys))
            return [False] * len(keys)
        pages = [self._page_bytes(v) for v in values]
        if len(pages) != len(keys) or any(p is None for p in pages):
            return [False] * len(keys)
        try:
            return self._store(keys, pages)  # type: ignore[arg-type]
        except kvcm.KvcmError as e:
            self._failed(f"store of {len(keys)} pages", e)
            return [False] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self._set_pages([key], [value])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return all(self._set_pages(keys, list(values or [])))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        values = [pool.get_data_page(host_indices[i * pool.page_size], flat=True)
                  for i in range(len(keys))]
        return self._set_pages(keys, values)

    # ---- get ----------------------------------------------------------------------------

    def _read(self, block: int, tier: int, epoch: int, h: bytes) -> bytes:
        """The block's bytes, if it still holds page `h` (the agent checks under its lock:
        a pin whose lease ran out may have let the block go to another page)."""
        return self.agent.read(self.ns, [block], epoch=epoch, tier=tier, page_hashes=[h])

    def _match(self, h: bytes, *, pin: bool) -> kvcm.MatchResult:
        return self._client.match(self.ns, page_hashes=[h], requester_agent_id=self._opts.agent_id,
                                  pin=pin, probe=not pin,
                                  lease_ttl_ms=self._opts.lease_ttl_ms if pin else 0,
                                  deadline_ms=self._opts.request_deadline_ms)

    def _release(self, pin_id: int) -> None:
        if pin_id:
            try:
                self._client.release(self.ns, pin_id)
            except kvcm.KvcmError as e:  # the lease ends it anyway
                logger.info("KvcmHiCacheStorage: release of pin %d failed: %s", pin_id, e)

    def _local_replica(self, match: kvcm.MatchResult) -> Optional[kvcm.PageReplica]:
        for r in match.pages[0] if match.matched_pages else []:
            if r.pool.agent_id == self._opts.agent_id and r.block_id != PENDING_BLOCK_ID:
                return r
        return None

    def _get_page(self, key: str) -> Optional[bytes]:
        """The page's bytes from any agent (pulled into the local one first), or None."""
        h = self._hash(key)
        match = self._match(h, pin=True)
        try:
            if not match.matched_pages:
                self._count("misses")
                return None
            epoch = self._agent_epoch()
            local = self._local_replica(match)
            if local is not None:
                data = self._read(local.block_id, int(local.pool.tier), epoch, h)
                self._count("local_hits")
                return data
            remote = next((r for r in match.pages[0] if r.block_id != PENDING_BLOCK_ID), None)
            if remote is None:
                self._count("misses")
                return None
            self._fetch(h, remote)
        finally:
            self._release(match.pin_id)
        # Now a local replica: pinned again, so that it cannot be evicted while read.
        match = self._match(h, pin=True)
        try:
            local = self._local_replica(match)
            if local is None:
                self._count("misses")
                return None
            data = self._read(local.block_id, int(local.pool.tier), epoch, h)
            self._count("fetched_pages")
            return data
        finally:
            self._release(match.pin_id)

    def _fetch(self, h: bytes, source: kvcm.PageReplica) -> None:
        self.agent.fetch(self._client, self.ns, [h], source_agent_id=source.pool.agent_id,
                         source_tier=int(source.pool.tier), source_block_ids=[source.block_id],
                         tier=int(self._pool.tier))

    def _get_into(self, key: str, target: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.ns is None:
            self._count("refused_unattached")
            return None
        if target is not None and target.numel() * target.element_size() != self.bytes_per_page:
            self._count("refused_page_size")
            return None
        try:
            data = self._get_page(key)
        except kvcm.KvcmError as e:
            self._failed(f"get of {key}", e)
            return None
        if data is None:
            return None
        if len(data) != self.bytes_per_page:
            self._count("errors")
            return None
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if target is None:
            return src.view(self.mem_pool_host.dtype)
        target.view(torch.uint8).reshape(-1).copy_(src)
        return target

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self._get_into(key, target_location)

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Stops at the first miss (SGLang uses only the leading run of hits)."""
        targets = list(target_locations or [None] * len(keys))
        out: List[Optional[torch.Tensor]] = [None] * len(keys)
        for i, (key, target) in enumerate(zip(keys, targets)):
            out[i] = self._get_into(key, target)
            if out[i] is None:
                break
        return out

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        ok = [False] * len(keys)
        for i, key in enumerate(keys):
            page = self._get_into(key, pool.get_dummy_flat_data_page())
            if page is None:
                break
            pool.set_from_flat_data_page(host_indices[i * pool.page_size], page)
            ok[i] = True
        return ok

    # ---- exists -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        if self.ns is None:
            return False
        try:
            return self._match(self._hash(key), pin=False).matched_pages > 0
        except kvcm.KvcmError as e:
            self._failed(f"exists of {key}", e)
            return False

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    # ---- v2: the KV pool only -----------------------------------------------------------

    def batch_exists_v2(self, keys: List[str],
                        pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None
                        ) -> PoolTransferResult:
        """Sidecar pools (Mamba, SWA, indexer) are not stored: with any, nothing hits."""
        if any(t.name != PoolName.KV for t in pool_transfers or []):
            return PoolTransferResult(0, {}, [])
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {},
                                  list(range(1, hits + 1)))

    def _v2(self, transfers: List[PoolTransfer], get: bool) -> Dict[str, List[bool]]:
        results: Dict[str, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            if t.name != PoolName.KV or t.host_indices is None:
                results[t.name] = [False] * len(keys)
                continue
            results[t.name] = (self.batch_get_v1 if get else self.batch_set_v1)(
                keys, t.host_indices)
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[str, List[bool]]:
        return self._v2(transfers, get=True)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[str, List[bool]]:
        return self._v2(transfers, get=False)

    # ---- lifecycle ----------------------------------------------------------------------

    def clear(self) -> bool:
        """Refused (False): the pages are the cluster's, shared with other engines and
        agents; the manager's eviction and the namespace's retention remove them."""
        logger.info("KvcmHiCacheStorage: clear refused: kvcm pages are shared cluster-wide")
        return False

    def close(self) -> None:
        self.agent.close()
        self._client.close()
