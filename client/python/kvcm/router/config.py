"""kvcm-router configuration: a TOML file and/or flags (a flag wins over the file).

    listen_address = "0.0.0.0:8100"  # default 127.0.0.1:8100 (8000 is vLLM's)
    policy = "kv-aware"              # kv-aware | round-robin | consistent-hash | least-loaded
    tokenizer = "meta-llama/Meta-Llama-3-8B-Instruct"   # or a path; "words"/"bytes": tests
    lora_adapters = ["sql-lora"]     # a request whose model is one of these uses that LoRA
    engines = ["vllm-0=http://10.0.0.5:8000", "vllm-1=http://10.0.0.6:8000"]
    # or, prefill/decode disaggregation (instead of engines; policy picks the prefill engine):
    # prefill_engines = ["p0=http://10.0.0.5:8000"]
    # decode_engines = ["d0=http://10.0.0.6:8000"]
    # engine_agents = ["p0=gpu0", "d0=gpu0"]  # kvcm-agent of a connector engine (default: id)

    manager_address = "kvcm.internal:50051"  # kv-aware only; default $KVCM_MANAGER_ADDRESS
    tls_ca_file = "/etc/kvcm/ca.pem"  # or insecure = true
    token_file = "/etc/kvcm/router.token"  # or token = "..." (this file only, never a flag)
    register_token_file = ""         # a token that may RegisterModel, for the hash key

    tokens_file = "/etc/kvcm/tokens"  # clients' bearer tokens (the manager's format); "": none
    max_response_bytes = 16777216    # a non-streamed engine answer larger than this: 502

    [namespace]                      # the bridge's: same tenant, model, spec, page size
    tenant = "acme"
    model = "llama-3-8b"
    preset = "llama-3-8b"            # a catalogue model, or a [namespace.spec] table
    kv_dtype = "bf16"
    page_size_tokens = 16            # kvcm page, a multiple of block_size
    block_size = 16                  # the engines' block size

Engine ids are the ids kvcm-bridge publishes the engines under; an engine listed in
engine_agents is ranked by the pages of that kvcm-agent instead (the kvcm vLLM connector).
Settings and flags before issue 26's vocabulary still work and warn once: listen, manager,
ca_file / cert_file / key_file, dtype, page_size.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from kvcm import _cli
from kvcm._options import MANAGER_ADDRESS_ENV, validate_address
from kvcm.router.policy import POLICIES
from kvcm.types import CATALOG, AttentionKind, KvDtype, ModelSpec, Namespace

_ENGINE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_DTYPES = {"bf16": KvDtype.BF16, "fp16": KvDtype.FP16, "fp8": KvDtype.FP8,
           "int8": KvDtype.INT8}
_ATTENTION = {"mha": AttentionKind.MHA, "mqa": AttentionKind.MQA, "gqa": AttentionKind.GQA,
              "mla": AttentionKind.MLA}
PROG = "kvcm-router"
LISTEN_PORT = 8100  # vLLM's is 8000
# Deprecated spellings -> names (flags and TOML keys alike).
_ALIASES = {"listen": "listen_address", "manager": "manager_address",
            "ca_file": "tls_ca_file", "cert_file": "tls_cert_file", "key_file": "tls_key_file"}
_NAMESPACE_ALIASES = {"dtype": "kv_dtype", "page_size": "page_size_tokens"}
_FLAG_ALIASES = {**_ALIASES, **_NAMESPACE_ALIASES}


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
    kv_dtype: str = "bf16"
    page_size_tokens: int = 0  # tokens per kvcm page; 0: block_size
    block_size: int = 16  # the engines' KV block size, tokens

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.tenant, self.model)

    @property
    def page_tokens(self) -> int:
        return self.page_size_tokens or self.block_size

    def model_spec(self) -> ModelSpec:
        if self.spec:
            if self.preset:
                raise ConfigError("namespace: give preset or spec, not both")
            kw = dict(self.spec)
            try:
                kw["attention"] = _ATTENTION[str(kw.get("attention", "")).lower()]
                kw["dtype"] = _DTYPES[str(kw.get("dtype", self.kv_dtype)).lower()]
                return ModelSpec(page_size_tokens=self.page_tokens, **kw)
            except (KeyError, TypeError) as e:
                raise ConfigError(f"namespace.spec: {e}") from None
        base = CATALOG.get(self.preset.lower())
        if base is None:
            raise ConfigError(f"namespace.preset: {self.preset!r} is not a catalogue model; "
                              f"known: {', '.join(CATALOG)}")
        return base.with_(dtype=_DTYPES[self.kv_dtype], page_size_tokens=self.page_tokens)


@dataclass
class RouterConfig:
    listen_address: str = f"127.0.0.1:{LISTEN_PORT}"
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
    # Manager connection (kv-aware). "": $KVCM_MANAGER_ADDRESS when load_config reads it.
    manager_address: str = ""
    insecure: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
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
    # Clients' bearer tokens, in the manager's tokens-file format (kvcm.tokens); "": clients
    # are not authenticated (a loopback listener only, or a trusted network).
    tokens_file: str = ""
    # The most of one engine answer the router holds in memory, bytes: a non-streamed answer
    # (or an error body, or a P/D prefill answer) over it is cut with a 502 naming this.
    # Streamed answers pass through chunk by chunk and are not capped in total.
    max_response_bytes: int = 16 * 1024 * 1024
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
        host, _, port = self.listen_address.rpartition(":")
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
            validate_address(self.listen_address, "listen_address", LISTEN_PORT, "kvcm-router")
            if self.manager_address:
                validate_address(self.manager_address, "manager_address")
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("INVALID_ARGUMENT: ")) from None
        ns = self.namespace
        if ns.block_size <= 0:
            raise ConfigError("namespace.block_size: must be > 0")
        if ns.page_size_tokens < 0 or ns.page_tokens % ns.block_size != 0:
            raise ConfigError(f"namespace.page_size_tokens: {ns.page_size_tokens} must be a "
                              f"multiple of namespace.block_size {ns.block_size}")
        if ns.kv_dtype not in _DTYPES:
            raise ConfigError(f"namespace.kv_dtype: {ns.kv_dtype!r} is not one of "
                              f"{sorted(_DTYPES)}")
        if self.policy == "kv-aware":
            if not self.manager_address:
                raise ConfigError(f"manager_address: required by policy kv-aware (HOST:PORT, "
                                  f"or ${MANAGER_ADDRESS_ENV})")
            if not ns.tenant or not ns.model:
                raise ConfigError("namespace.tenant and namespace.model: required by kv-aware "
                                  "(the bridge's namespace)")
            ns.model_spec()
            if not self.insecure and not self.tls_ca_file:
                raise ConfigError("tls_ca_file: required to verify the manager "
                                  "(or insecure = true)")
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
        if not 1024 <= self.max_response_bytes <= 1 << 40:
            raise ConfigError("max_response_bytes: must be in 1024..2^40")


def _from_toml(data: Dict[str, Any], where: str = "config") -> RouterConfig:
    cfg = RouterConfig()
    known = {f.name for f in fields(RouterConfig)}
    try:
        data = _cli.rename_keys(data, _ALIASES, PROG, where)
        if isinstance(data.get("namespace"), dict):
            data["namespace"] = _cli.rename_keys(data["namespace"], _NAMESPACE_ALIASES, PROG,
                                                 f"{where} [namespace]")
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="KV-aware OpenAI-compatible router in front of inference engines "
                    "(docs/ROUTER.md). Every --a_b flag may also be spelled --a-b. Deprecated "
                    "spellings (--listen, --manager, --ca_file, --cert_file, --key_file, "
                    "--dtype, --page_size) still work and warn.")
    p.add_argument("--version", action=_cli.VersionAction)
    p.add_argument("--config", help="TOML file; flags override its settings")
    p.add_argument("--listen_address", help=f"HOST:PORT to serve on (default "
                                            f"127.0.0.1:{LISTEN_PORT}, loopback only; "
                                            "0.0.0.0:PORT to serve other hosts)")
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
    p.add_argument("--manager_address", help=f"kvcm-manager HOST:PORT (default "
                                             f"${MANAGER_ADDRESS_ENV})")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="plaintext to the manager (dev only)")
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file", "token_file",
                 "register_token_file"):
        p.add_argument(f"--{name}")
    p.add_argument("--tenant")
    p.add_argument("--model", help="namespace model (the bridge's)")
    p.add_argument("--preset", help="catalogue model spec of the namespace")
    p.add_argument("--kv_dtype", help="bf16, fp16, fp8 or int8")
    p.add_argument("--page_size_tokens", type=int, help="tokens per kvcm page (0: block_size)")
    p.add_argument("--block_size", type=int)
    p.add_argument("--prefill_tokens_per_s", type=float)
    p.add_argument("--route_deadline_ms", type=int)
    p.add_argument("--imbalance_factor", type=float)
    p.add_argument("--imbalance_margin", type=int)
    p.add_argument("--hash_prefix_pages", type=int)
    p.add_argument("--engine_down_s", type=float)
    p.add_argument("--upstream_timeout_s", type=float)
    p.add_argument("--tokens_file", help="clients' bearer tokens, the manager's tokens-file "
                                         "format: clients must send one (default: none, "
                                         "clients are not authenticated)")
    p.add_argument("--max_response_bytes", type=int,
                   help="the most of a non-streamed engine answer held, bytes (default "
                        "16 MiB); a larger one is a 502")
    p.add_argument("--log_level", choices=("debug", "info", "warning", "error"))
    return p


def load_config(argv: Optional[List[str]] = None, prog: str = PROG) -> RouterConfig:
    """The configuration from argv (and the TOML file it names), validated. The manager's
    address, given neither by flag nor file, is $KVCM_MANAGER_ADDRESS."""
    import os
    import sys

    argv = _cli.rename_flags(sys.argv[1:] if argv is None else argv, _FLAG_ALIASES, prog)
    args = build_parser(prog).parse_args(argv)
    cfg = RouterConfig()
    if args.config:
        try:
            with open(args.config, "rb") as f:
                cfg = _from_toml(tomllib.load(f), args.config)
        except OSError as e:
            raise ConfigError(f"config {args.config!r}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {args.config!r}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"config {args.config!r}: {e}") from None
    for name in ("listen_address", "policy", "tokenizer", "manager_address", "insecure",
                 "tls_ca_file", "tls_cert_file", "tls_key_file", "token_file",
                 "register_token_file",
                 "prefill_tokens_per_s", "route_deadline_ms", "imbalance_factor",
                 "imbalance_margin", "hash_prefix_pages", "engine_down_s",
                 "upstream_timeout_s", "tokens_file", "max_response_bytes", "log_level"):
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
    for name in ("tenant", "model", "preset", "kv_dtype", "page_size_tokens", "block_size"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg.namespace, name, value)
    if not cfg.manager_address:
        cfg.manager_address = os.environ.get(MANAGER_ADDRESS_ENV, "")
    cfg.validate()
    return cfg


__all__ = ["ConfigError", "EngineSpec", "NamespaceConfig", "RouterConfig", "load_config",
           "parse_engine", "parse_engine_agent"]
