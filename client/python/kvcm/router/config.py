"""kvcm-router configuration: a TOML file and/or flags (a flag wins over the file).

    listen = "0.0.0.0:8000"
    policy = "kv-aware"              # kv-aware | round-robin | consistent-hash | least-loaded
    tokenizer = "meta-llama/Meta-Llama-3-8B-Instruct"   # or a path; "words"/"bytes": tests
    lora_adapters = ["sql-lora"]     # a request whose model is one of these uses that LoRA
    engines = ["vllm-0=http://10.0.0.5:8000", "vllm-1=http://10.0.0.6:8000"]
    # or, prefill/decode disaggregation (instead of engines; policy picks the prefill engine):
    # prefill_engines = ["p0=http://10.0.0.5:8000"]
    # decode_engines = ["d0=http://10.0.0.6:8000"]
    # engine_agents = ["p0=gpu0", "d0=gpu0"]  # kvcm-agent of a connector engine (default: id)

    manager = "kvcm.internal:50051"  # kv-aware only
    ca_file = "/etc/kvcm/ca.pem"     # or insecure = true
    token_file = "/etc/kvcm/router.token"  # or token = "..." (this file only, never a flag)
    register_token_file = ""         # a token that may RegisterModel, for the hash key

    [namespace]                      # the bridge's: same tenant, model, spec, page size
    tenant = "acme"
    model = "llama-3-8b"
    preset = "llama-3-8b"            # a catalogue model, or a [namespace.spec] table
    dtype = "bf16"
    page_size = 16                   # kvcm page, a multiple of block_size
    block_size = 16                  # the engines' block size

Engine ids are the ids kvcm-bridge publishes the engines under; an engine listed in
engine_agents is ranked by the pages of that kvcm-agent instead (the kvcm vLLM connector).
"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from kvcm.router.policy import POLICIES
from kvcm.types import CATALOG, AttentionKind, KvDtype, ModelSpec, Namespace

_ENGINE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_DTYPES = {"bf16": KvDtype.BF16, "fp16": KvDtype.FP16, "fp8": KvDtype.FP8,
           "int8": KvDtype.INT8}
_ATTENTION = {"mha": AttentionKind.MHA, "mqa": AttentionKind.MQA, "gqa": AttentionKind.GQA,
              "mla": AttentionKind.MLA}


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the setting."""


@dataclass(frozen=True)
class EngineSpec:
    id: str
    url: str  # base URL, e.g. http://10.0.0.5:8000 (the router appends /v1/...)


def parse_engine(text: str, where: str = "engines") -> EngineSpec:
    """'id=url' as an EngineSpec; ConfigError naming `where` otherwise."""
    engine_id, sep, url = text.partition("=")
    engine_id, url = engine_id.strip(), url.strip().rstrip("/")
    if not sep or not _ENGINE_ID.match(engine_id):
        raise ConfigError(f"{where}: {text!r} must be ID=URL with ID 1..128 of [A-Za-z0-9._:-]")
    if not re.match(r"^https?://[^/]+", url):
        raise ConfigError(f"{where}: engine {engine_id!r}: url {url!r} must be http(s)://HOST:PORT")
    if url.endswith("/v1"):
        url = url[:-3]
    return EngineSpec(engine_id, url)


def parse_engine_agent(text: str, where: str = "engine_agents") -> Tuple[str, str]:
    """'engine=agent' as a pair; ConfigError naming `where` otherwise."""
    engine_id, sep, agent_id = (p.strip() for p in text.partition("="))
    if not sep or not _ENGINE_ID.match(engine_id) or not _ENGINE_ID.match(agent_id):
        raise ConfigError(f"{where}: {text!r} must be ENGINE=AGENT, each 1..128 of "
                          "[A-Za-z0-9._:-]")
    return engine_id, agent_id


@dataclass
class NamespaceConfig:
    tenant: str = ""
    model: str = ""
    preset: str = ""  # a catalogue model (kvcm.CATALOG), or `spec`
    spec: Dict[str, Any] = field(default_factory=dict)  # ModelSpec fields (TOML table)
    dtype: str = "bf16"
    page_size: int = 0  # tokens per kvcm page; 0: block_size
    block_size: int = 16  # the engines' KV block size, tokens

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.tenant, self.model)

    @property
    def page_tokens(self) -> int:
        return self.page_size or self.block_size

    def model_spec(self) -> ModelSpec:
        if self.spec:
            if self.preset:
                raise ConfigError("namespace: give preset or spec, not both")
            kw = dict(self.spec)
            try:
                kw["attention"] = _ATTENTION[str(kw.get("attention", "")).lower()]
                kw["dtype"] = _DTYPES[str(kw.get("dtype", self.dtype)).lower()]
                return ModelSpec(page_size_tokens=self.page_tokens, **kw)
            except (KeyError, TypeError) as e:
                raise ConfigError(f"namespace.spec: {e}") from None
        base = CATALOG.get(self.preset.lower())
        if base is None:
            raise ConfigError(f"namespace.preset: {self.preset!r} is not a catalogue model; "
                              f"known: {', '.join(CATALOG)}")
        return base.with_(dtype=_DTYPES[self.dtype], page_size_tokens=self.page_tokens)


@dataclass
class RouterConfig:
    listen: str = "127.0.0.1:8000"
    policy: str = "kv-aware"
    tokenizer: str = ""
    engines: List[EngineSpec] = field(default_factory=list)
    # Prefill/decode disaggregation: both lists instead of `engines`.
    prefill_engines: List[EngineSpec] = field(default_factory=list)
    decode_engines: List[EngineSpec] = field(default_factory=list)
    # engine id -> the kvcm-agent its connector stores into and loads from.
    engine_agents: Dict[str, str] = field(default_factory=dict)
    lora_adapters: List[str] = field(default_factory=list)
    namespace: NamespaceConfig = field(default_factory=NamespaceConfig)
    # Manager connection (kv-aware).
    manager: str = ""
    insecure: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token_file: str = ""  # the router's token; else `token` (TOML only), else $KVCM_TOKEN
    token: str = field(default="", repr=False)
    register_token_file: str = ""  # a token that may RegisterModel; "": token_file's
    # Route: the prefill throughput the queue charge uses, tokens/s per engine.
    prefill_tokens_per_s: float = 10_000.0
    route_deadline_ms: int = 200
    # Bounded imbalance (kv-aware, consistent-hash): in_flight <= factor*least + margin;
    # factor < 0 disables it.
    imbalance_factor: float = 2.0
    imbalance_margin: int = 4
    hash_prefix_pages: int = 1  # consistent-hash: pages of the prompt hashed onto the ring
    # Engines that fail are avoided for engine_down_s, doubling per failure up to 30 s.
    engine_down_s: float = 2.0
    upstream_timeout_s: float = 600.0
    log_level: str = "info"

    @property
    def pd(self) -> bool:
        """Prefill/decode disaggregation: prefill_engines and decode_engines are given."""
        return bool(self.prefill_engines or self.decode_engines)

    @property
    def all_engines(self) -> List[EngineSpec]:
        return self.engines + self.prefill_engines + self.decode_engines

    @property
    def listen_host_port(self) -> Tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.pd:
            if self.engines:
                raise ConfigError("engines: not with prefill_engines / decode_engines (P/D)")
            if not self.prefill_engines or not self.decode_engines:
                raise ConfigError("prefill_engines and decode_engines: P/D needs at least one "
                                  "ID=URL in each")
        elif not self.engines:
            raise ConfigError("engines: at least one ID=URL is required")
        ids = [e.id for e in self.all_engines]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ConfigError(f"engines: id {sorted(dup)[0]!r} is listed twice")
        unknown = sorted(set(self.engine_agents) - set(ids))
        if unknown:
            raise ConfigError(f"engine_agents: {unknown[0]!r} is not a configured engine")
        if not self.tokenizer:
            raise ConfigError("tokenizer: required: the engines' Hugging Face tokenizer (name "
                              "or path), or 'words' / 'bytes' (test tokenizers)")
        try:
            _, port = self.listen_host_port
        except ValueError:
            raise ConfigError(f"listen: {self.listen!r} must be HOST:PORT") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"listen: port {port} out of range")
        ns = self.namespace
        if ns.block_size <= 0:
            raise ConfigError("namespace.block_size: must be > 0")
        if ns.page_size < 0 or ns.page_tokens % ns.block_size != 0:
            raise ConfigError(f"namespace.page_size: {ns.page_size} must be a multiple of "
                              f"namespace.block_size {ns.block_size}")
        if ns.dtype not in _DTYPES:
            raise ConfigError(f"namespace.dtype: {ns.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.policy == "kv-aware":
            if not self.manager:
                raise ConfigError("manager: required by policy kv-aware (HOST:PORT)")
            if not ns.tenant or not ns.model:
                raise ConfigError("namespace.tenant and namespace.model: required by kv-aware "
                                  "(the bridge's namespace)")
            ns.model_spec()
            if not self.insecure and not self.ca_file:
                raise ConfigError("ca_file: required to verify the manager (or insecure = true)")
        if self.token and self.token_file:
            raise ConfigError("token: give token or token_file, not both")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError("prefill_tokens_per_s: must be > 0")
        if self.route_deadline_ms <= 0:
            raise ConfigError("route_deadline_ms: must be > 0")
        if self.imbalance_margin < 0:
            raise ConfigError("imbalance_margin: must be >= 0")
        if self.hash_prefix_pages <= 0:
            raise ConfigError("hash_prefix_pages: must be > 0")
        if self.engine_down_s <= 0 or self.upstream_timeout_s <= 0:
            raise ConfigError("engine_down_s and upstream_timeout_s: must be > 0")


def _from_toml(data: Dict[str, Any]) -> RouterConfig:
    cfg = RouterConfig()
    known = {f.name for f in fields(RouterConfig)}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{key}: unknown setting")
        if key in ("engines", "prefill_engines", "decode_engines"):
            if not isinstance(value, list):
                raise ConfigError(f"{key}: must be a list of \"ID=URL\" strings")
            setattr(cfg, key, [parse_engine(str(v), f"{key}[{i}]") for i, v in enumerate(value)])
        elif key == "engine_agents":
            if not isinstance(value, list):
                raise ConfigError("engine_agents: must be a list of \"ENGINE=AGENT\" strings")
            cfg.engine_agents = dict(parse_engine_agent(str(v), f"engine_agents[{i}]")
                                     for i, v in enumerate(value))
        elif key == "namespace":
            if not isinstance(value, dict):
                raise ConfigError("namespace: must be a table")
            ns_known = {f.name for f in fields(NamespaceConfig)}
            for k in value:
                if k not in ns_known:
                    raise ConfigError(f"namespace.{k}: unknown setting")
            cfg.namespace = NamespaceConfig(**value)
        else:
            setattr(cfg, key, value)
    return cfg


class _Parser(argparse.ArgumentParser):
    """Each --a_b option also answers to --a-b."""

    def add_argument(self, *names: Any, **kw: Any) -> Any:
        more = [n.replace("_", "-") for n in names
                if isinstance(n, str) and n.startswith("--") and "_" in n]
        return super().add_argument(*names, *more, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvcm-router",
        description="KV-aware OpenAI-compatible router in front of inference engines "
                    "(docs/ROUTER.md). Every --a_b flag may also be spelled --a-b.")
    p.add_argument("--config", help="TOML file; flags override its settings")
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:8000)")
    p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--tokenizer", help="Hugging Face tokenizer name or path; 'words' or "
                                       "'bytes' for tests")
    p.add_argument("--engine", action="append", metavar="ID=URL",
                   help="an engine (repeatable); replaces the file's engines")
    p.add_argument("--prefill_engine", action="append", metavar="ID=URL",
                   help="P/D: a prefill engine (repeatable); replaces the file's list")
    p.add_argument("--decode_engine", action="append", metavar="ID=URL",
                   help="P/D: a decode engine (repeatable); replaces the file's list")
    p.add_argument("--engine_agent", action="append", metavar="ENGINE=AGENT",
                   help="the kvcm-agent of a connector engine (repeatable); replaces the "
                        "file's engine_agents")
    p.add_argument("--lora_adapter", action="append", metavar="NAME",
                   help="a LoRA adapter name served by the engines (repeatable)")
    p.add_argument("--manager", help="kvcm-manager HOST:PORT")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="plaintext to the manager (dev only)")
    for name in ("ca_file", "cert_file", "key_file", "token_file", "register_token_file"):
        p.add_argument(f"--{name}")
    p.add_argument("--tenant")
    p.add_argument("--model", help="namespace model (the bridge's)")
    p.add_argument("--preset", help="catalogue model spec of the namespace")
    p.add_argument("--dtype")
    p.add_argument("--page_size", type=int)
    p.add_argument("--block_size", type=int)
    p.add_argument("--prefill_tokens_per_s", type=float)
    p.add_argument("--route_deadline_ms", type=int)
    p.add_argument("--imbalance_factor", type=float)
    p.add_argument("--imbalance_margin", type=int)
    p.add_argument("--hash_prefix_pages", type=int)
    p.add_argument("--engine_down_s", type=float)
    p.add_argument("--upstream_timeout_s", type=float)
    p.add_argument("--log_level", choices=("debug", "info", "warning", "error"))
    return p


def load_config(argv: Optional[List[str]] = None) -> RouterConfig:
    """The configuration from argv (and the TOML file it names), validated."""
    args = build_parser().parse_args(argv)
    cfg = RouterConfig()
    if args.config:
        try:
            with open(args.config, "rb") as f:
                cfg = _from_toml(tomllib.load(f))
        except OSError as e:
            raise ConfigError(f"config {args.config!r}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {args.config!r}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"config {args.config!r}: {e}") from None
    for name in ("listen", "policy", "tokenizer", "manager", "insecure", "ca_file",
                 "cert_file", "key_file", "token_file", "register_token_file",
                 "prefill_tokens_per_s", "route_deadline_ms", "imbalance_factor",
                 "imbalance_margin", "hash_prefix_pages", "engine_down_s",
                 "upstream_timeout_s", "log_level"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.engine:
        cfg.engines = [parse_engine(e, "--engine") for e in args.engine]
    if args.prefill_engine:
        cfg.prefill_engines = [parse_engine(e, "--prefill_engine") for e in args.prefill_engine]
    if args.decode_engine:
        cfg.decode_engines = [parse_engine(e, "--decode_engine") for e in args.decode_engine]
    if args.engine_agent:
        cfg.engine_agents = dict(parse_engine_agent(e, "--engine_agent")
                                 for e in args.engine_agent)
    if args.lora_adapter:
        cfg.lora_adapters = list(args.lora_adapter)
    for flag, attr in (("tenant", "tenant"), ("model", "model"), ("preset", "preset"),
                       ("dtype", "dtype"), ("page_size", "page_size"),
                       ("block_size", "block_size")):
        value = getattr(args, flag)
        if value is not None:
            setattr(cfg.namespace, attr, value)
    cfg.validate()
    return cfg


__all__ = ["ConfigError", "EngineSpec", "NamespaceConfig", "RouterConfig", "load_config",
           "parse_engine", "parse_engine_agent"]
