"""kvcm-bridge configuration: a TOML file and/or flags (flags win).

    manager_address = "kvcm.internal:50051"   # default: $KVCM_MANAGER_ADDRESS
    tls_ca_file = "/etc/kvcm/ca.pem"      # or insecure = true
    metrics_address = "0.0.0.0:9466"      # default: no /metrics
    engine_timeout_s = 15

    [namespace]                           # every engine's, unless an engine overrides it
    tenant = "acme"
    model = "llama-3-8b"
    preset = "llama-3-8b"                 # a catalogue model, or a [namespace.spec] table
    kv_dtype = "bf16"
    page_size_tokens = 16                 # 0: the engine's block size

    [[engine]]
    id = "vllm-0"
    kind = "vllm"                         # or "sglang" (kvcm.engines.kinds)
    endpoint = "tcp://10.0.0.5:5557"      # vLLM's --kv-events-config endpoint, as we reach it
    endpoint_mode = "connect"             # vLLM binds tcp://*:5557: we connect (the default)
    replay_endpoint = "tcp://10.0.0.5:5558"
    token_file = "/etc/kvcm/vllm-0.token"
    block_size = 16

vLLM binds its PUB endpoint when it holds `*` (or `::`, ipc://, inproc://) and connects to it
otherwise. So: vLLM given `tcp://*:5557` -> endpoint = "tcp://<engine host>:5557", mode
"connect"; vLLM given `tcp://<bridge host>:5557` -> endpoint = "tcp://*:5557", mode "bind".
vLLM always binds its replay (ROUTER) endpoint; the bridge connects to it. SGLang's
publisher (`--kv-events-config`) decides bind/connect the same way (docs/ENGINES.md, "SGLang").

Bind mode listens for publishers: only on loopback (or ipc://) unless the engine has CURVE
keys (curve_secret_key_file, curve_publisher_keys_dir), and it takes batches from one
publisher connection at a time (docs/SECURITY.md, "kvcm-bridge"). Every frame is capped at
max_frame_bytes (ZMQ drops a larger one, and its connection, before allocating it).

Settings and flags before issue 26's vocabulary still work and warn once: manager,
ca_file / cert_file / key_file, metrics_port (with metrics_address a bare host), dtype,
page_size.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from kvcm import _cli
from kvcm._net import is_loopback_host
from kvcm._options import default_manager_address, validate_address
from kvcm.engines import kinds
from kvcm.types import CATALOG, AttentionKind, KvDtype, ModelSpec

_ENGINE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_ENDPOINT = re.compile(r"^(tcp|ipc|inproc)://.+")
_DTYPES = {"bf16": KvDtype.BF16, "fp16": KvDtype.FP16, "fp8": KvDtype.FP8,
           "int8": KvDtype.INT8}
_ATTENTION = {"mha": AttentionKind.MHA, "mqa": AttentionKind.MQA, "gqa": AttentionKind.GQA,
              "mla": AttentionKind.MLA}
PROG = "kvcm-bridge"
METRICS_PORT = 9466
# Deprecated spellings -> names (flags and TOML keys alike).
_ALIASES = {"manager": "manager_address", "ca_file": "tls_ca_file",
            "cert_file": "tls_cert_file", "key_file": "tls_key_file"}
_NAMESPACE_ALIASES = {"dtype": "kv_dtype", "page_size": "page_size_tokens"}
_FLAG_ALIASES = {**_ALIASES, **_NAMESPACE_ALIASES}


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the setting."""


@dataclass
class NamespaceConfig:
    tenant: str = ""
    model: str = ""
    # A catalogue model (kvcm.CATALOG), or `spec` with the ModelSpec fields.
    preset: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    kv_dtype: str = "bf16"
    # Tokens per kvcm page: a multiple of the engine's block size; 0: the block size.
    page_size_tokens: int = 0
    max_page_age_s: int = 0

    def model_spec(self, block_size: int) -> ModelSpec:
        page = self.page_size_tokens or block_size
        if self.kv_dtype not in _DTYPES:
            raise ConfigError(f"namespace.kv_dtype: {self.kv_dtype!r} is not one of "
                              f"{sorted(_DTYPES)}")
        if self.preset:
            if self.spec:
                raise ConfigError("namespace: give preset or spec, not both")
            base = CATALOG.get(self.preset.lower())
            if base is None:
                raise ConfigError(f"namespace.preset: no model {self.preset!r} in the "
                                  f"catalogue; known: {', '.join(CATALOG)}")
            return base.with_(dtype=_DTYPES[self.kv_dtype], page_size_tokens=page)
        if not self.spec:
            raise ConfigError("namespace: needs preset (a catalogue model) or a spec table")
        kw = dict(self.spec)
        try:
            kw["attention"] = _ATTENTION[str(kw.get("attention", "")).lower()]
            kw.setdefault("dtype", self.kv_dtype)
            kw["dtype"] = _DTYPES[str(kw["dtype"]).lower()]
            return ModelSpec(page_size_tokens=page, **kw)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"namespace.spec: {e}") from None


@dataclass
class EngineConfig:
    id: str = ""
    # Whose events: "vllm" or "sglang" (kvcm.engines.kinds.names()).
    kind: str = "vllm"
    endpoint: str = ""
    endpoint_mode: str = "connect"
    replay_endpoint: str = ""
    topic: str = ""
    # The engine's bearer token (role engine): a file, an environment variable, or inline.
    token_file: str = ""
    token_env: str = ""
    token: str = field(default="", repr=False)
    # Only batches of this data-parallel rank (each rank publishes on its own port, port+rank).
    data_parallel_rank: int | None = None
    block_size: int = 16
    # vLLM KV-cache group whose events are mirrored (hybrid models emit one per group).
    kv_group: int = 0
    # Mirror LoRA blocks keyed by adapter name (vLLM 0.14 - 0.30 hash the name; >= 0.31 the
    # name and path, of which events carry the name). Off: LoRA blocks are refused. Turn on
    # only where every engine of the namespace maps each adapter name to one path.
    lora_by_name: bool = False
    # Refuse blocks from vLLM < 0.17 (no extra_keys in events): set when such engines serve
    # salted or multimodal requests, whose blocks would otherwise look plain.
    require_extra_keys: bool = False
    # Overrides of [namespace] for this engine.
    tenant: str = ""
    model: str = ""
    # Bind mode over CURVE: the bridge's certificate (a ZMQ secret certificate file, as
    # zmq.auth.create_certificates writes: "NAME.key_secret") and a directory of the
    # publishers' public certificates ("*.key"); only those publishers may connect. Without
    # them a bind endpoint must be loopback or ipc://.
    curve_secret_key_file: str = ""
    curve_publisher_keys_dir: str = ""

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key_file)

    def validate(self) -> None:
        where = f"engine {self.id!r}"
        if not _ENGINE_ID.match(self.id):
            raise ConfigError(f"engine.id: {self.id!r} must be 1..128 of [A-Za-z0-9._:-]")
        if self.kind not in kinds.names():
            raise ConfigError(f"{where}: kind {self.kind!r} is not one of {kinds.names()}")
        if not _ENDPOINT.match(self.endpoint):
            raise ConfigError(f"{where}: endpoint {self.endpoint!r} is not tcp://, ipc:// "
                              "or inproc://")
        if self.endpoint_mode not in ("connect", "bind"):
            raise ConfigError(f"{where}: endpoint_mode must be connect or bind")
        if self.endpoint_mode == "connect" and "*" in self.endpoint:
            raise ConfigError(
                f"{where}: cannot connect to {self.endpoint!r}: vLLM binds that wildcard "
                "endpoint, so connect to the engine's host (tcp://HOST:PORT), or set "
                "endpoint_mode = \"bind\" if vLLM was given this bridge's address")
        if self.replay_endpoint and (not _ENDPOINT.match(self.replay_endpoint)
                                     or "*" in self.replay_endpoint):
            raise ConfigError(f"{where}: replay_endpoint {self.replay_endpoint!r} must name "
                              "the engine's host (vLLM binds it; the bridge connects)")
        if self.block_size <= 0:
            raise ConfigError(f"{where}: block_size must be > 0")
        if bool(self.curve_secret_key_file) != bool(self.curve_publisher_keys_dir):
            raise ConfigError(f"{where}: CURVE needs both curve_secret_key_file and "
                              "curve_publisher_keys_dir")
        if self.curve and self.endpoint_mode != "bind":
            raise ConfigError(f"{where}: CURVE keys are for endpoint_mode \"bind\" (in "
                              "connect mode the bridge chooses whom it connects to)")
        if self.endpoint_mode == "bind" and not self.curve and not is_local_endpoint(
                self.endpoint):
            raise ConfigError(
                f"{where}: endpoint {self.endpoint!r} in bind mode would take KV events from "
                "any host that reaches it: bind a loopback address (tcp://127.0.0.1:PORT) "
                "or ipc://, or give curve_secret_key_file and curve_publisher_keys_dir "
                "(docs/SECURITY.md, \"kvcm-bridge\")")
        if self.curve:
            self.curve_keys()
        if sum(bool(x) for x in (self.token_file, self.token_env, self.token)) > 1:
            raise ConfigError(f"{where}: give one of token_file, token_env, token")

    def curve_keys(self) -> tuple[bytes, bytes]:
        """(public, secret) of curve_secret_key_file; ConfigError naming what is wrong."""
        import zmq.auth

        where = f"engine {self.id!r}"
        try:
            public, secret = zmq.auth.load_certificate(self.curve_secret_key_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: curve_secret_key_file {self.curve_secret_key_file!r}: "
                              f"{e}") from None
        if not secret:
            raise ConfigError(f"{where}: curve_secret_key_file {self.curve_secret_key_file!r} "
                              "holds no secret key (give the .key_secret file)")
        try:
            publishers = [n for n in os.listdir(self.curve_publisher_keys_dir)
                          if n.endswith(".key")]
        except OSError as e:
            raise ConfigError(f"{where}: curve_publisher_keys_dir "
                              f"{self.curve_publisher_keys_dir!r}: {e.strerror}") from None
        if not publishers:
            raise ConfigError(f"{where}: curve_publisher_keys_dir "
                              f"{self.curve_publisher_keys_dir!r} holds no *.key certificate: "
                              "no publisher could connect")
        return public, secret

    def resolve_token(self) -> str:
        """The engine's token ("" for none, e.g. a manager without a tokens file)."""
        if self.token_file:
            try:
                with open(self.token_file, encoding="ascii") as f:
                    return f.read().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"engine {self.id!r}: token_file {self.token_file!r}: "
                                  f"{e}") from None
        if self.token_env:
            if self.token_env not in os.environ:
                raise ConfigError(f"engine {self.id!r}: ${self.token_env} is not set")
            return os.environ[self.token_env].strip()
        return self.token


@dataclass
class BridgeConfig:
    # Default: $KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051.
    manager_address: str = field(default_factory=default_manager_address)
    insecure: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Token for RegisterModel when the engines' tokens may not register ("": the engine's).
    register_token_file: str = ""
    metrics_address: str = ""             # host:port of /metrics; "": none
    ttl_ms: int = 30_000                  # the engine session's TTL at the manager
    engine_timeout_s: float = 15.0        # nothing heard from an engine this long: drop it
    probe_interval_s: float = 2.0
    replay_timeout_s: float = 3.0
    deadline_ms: int = 5_000              # per manager call
    # The largest ZMQ frame taken from an engine (ZMQ_MAXMSGSIZE), bytes: a larger one is
    # dropped with its connection before it is allocated. vLLM's batches are far smaller.
    max_frame_bytes: int = 16 * 1024 * 1024
    namespace: NamespaceConfig = field(default_factory=NamespaceConfig)
    engines: list[EngineConfig] = field(default_factory=list)

    def validate(self) -> None:
        if not self.engines:
            raise ConfigError("no engine: add [[engine]] tables or --engine")
        ids = [e.id for e in self.engines]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"engine ids repeat: {ids}")
        for e in self.engines:
            e.validate()
            if not (e.tenant or self.namespace.tenant) or not (e.model or self.namespace.model):
                raise ConfigError(f"engine {e.id!r}: no tenant/model (set [namespace])")
            page = self.namespace.page_size_tokens or e.block_size
            if page % e.block_size:
                raise ConfigError(
                    f"engine {e.id!r}: namespace page size {page} tokens is not a multiple of "
                    f"the engine's block size {e.block_size} tokens")
            self.namespace.model_spec(e.block_size)
        try:
            validate_address(self.manager_address, "manager_address")
            if self.metrics_address:
                validate_address(self.metrics_address, "metrics_address", METRICS_PORT,
                                 "kvcm-bridge's /metrics")
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("INVALID_ARGUMENT: ")) from None
        if self.insecure and (self.tls_ca_file or self.tls_cert_file or self.tls_key_file):
            raise ConfigError("insecure excludes tls_ca_file, tls_cert_file, tls_key_file")
        if not self.insecure and not self.tls_ca_file:
            raise ConfigError("tls_ca_file is required to verify the manager "
                              "(or insecure = true)")
        if not 1_000 <= self.ttl_ms <= 600_000:
            raise ConfigError("ttl_ms must be in 1000..600000")
        if self.engine_timeout_s <= self.probe_interval_s:
            raise ConfigError("engine_timeout_s must exceed probe_interval_s")
        if not 4096 <= self.max_frame_bytes <= 1 << 31:
            raise ConfigError("max_frame_bytes must be in 4096..2^31")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is reachable from this host only: ipc://, inproc://, or tcp://
    on a loopback address (127.0.0.0/8, ::1, localhost)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    return is_loopback_host(endpoint.removeprefix("tcp://").rpartition(":")[0])


def _fill(obj: Any, table: dict[str, Any], where: str) -> None:
    known = {f.name for f in fields(obj)}
    for k, v in table.items():
        if k not in known:
            raise ConfigError(f"{where}: unknown setting {k!r}")
        setattr(obj, k, v)


def load(path: str | None) -> BridgeConfig:
    cfg = BridgeConfig()
    if not path:
        return cfg
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    ns = data.pop("namespace", {})
    engines = data.pop("engine", [])
    try:
        data = _cli.rename_keys(data, _ALIASES, PROG, path)
        ns = _cli.rename_keys(ns, _NAMESPACE_ALIASES, PROG, f"{path} [namespace]")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if "metrics_port" in data:
        _cli.warn_deprecated(PROG, f"{path}: key 'metrics_port'", "metrics_address host:port")
        data["metrics_address"] = _metrics_address(data.get("metrics_address", ""),
                                                   data.pop("metrics_port"))
    _fill(cfg, data, path)
    _fill(cfg.namespace, ns, f"{path} [namespace]")
    for i, t in enumerate(engines):
        engine = EngineConfig()
        _fill(engine, t, f"{path} [[engine]] #{i + 1}")
        cfg.engines.append(engine)
    return cfg


def _metrics_address(host: str, port: Any) -> str:
    """The deprecated metrics_port (0: none) with metrics_address as its bare host."""
    if not port:
        return ""
    return f"{host or '0.0.0.0'}:{int(port)}"


def parse_engine_flag(text: str) -> EngineConfig:
    """--engine id=vllm-0,endpoint=tcp://h:5557,replay_endpoint=tcp://h:5558,token_file=F"""
    e = EngineConfig()
    ints = {"block_size", "kv_group", "data_parallel_rank"}
    for part in filter(None, text.split(",")):
        k, sep, v = part.partition("=")
        if not sep:
            raise ConfigError(f"--engine: {part!r} is not key=value")
        if k == "token":
            raise ConfigError("--engine: no token on the command line (ps shows it); use "
                              "token_file or token_env")
        if k not in {f.name for f in fields(e)}:
            raise ConfigError(f"--engine: unknown key {k!r}")
        if k in ("lora_by_name", "require_extra_keys"):
            if v not in ("true", "false"):
                raise ConfigError(f"--engine: {k} must be true or false")
            setattr(e, k, v == "true")
            continue
        setattr(e, k, int(v) if k in ints else v)
    return e


def arg_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Mirror vLLM and SGLang engines' prefix caches into a kvcm-manager from "
                    "their KV events (docs/ENGINES.md). Deprecated spellings (--manager, "
                    "--ca_file, --cert_file, --key_file, --metrics_port, --dtype, "
                    "--page_size) still work and warn.")
    p.add_argument("--version", action=_cli.VersionAction)
    p.add_argument("--config", help="TOML file; flags override it")
    p.add_argument("--manager_address", help="manager host:port (default: "
                   "$KVCM_MANAGER_ADDRESS, else 127.0.0.1:50051)")
    p.add_argument("--insecure", action="store_true", default=None, help="plaintext gRPC")
    p.add_argument("--tls_ca_file", help="PEM CA that verifies the manager")
    p.add_argument("--tls_cert_file", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls_key_file", help="PEM key of --tls_cert_file")
    p.add_argument("--register_token_file")
    p.add_argument("--metrics_address", help=f"host:port of /metrics (e.g. "
                   f"0.0.0.0:{METRICS_PORT}); default none")
    p.add_argument("--metrics_port", type=int, help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--ttl_ms", type=int)
    p.add_argument("--engine_timeout_s", type=float)
    p.add_argument("--probe_interval_s", type=float)
    p.add_argument("--replay_timeout_s", type=float)
    p.add_argument("--max_frame_bytes", type=int,
                   help="largest ZMQ frame taken from an engine, bytes (default 16 MiB); a "
                        "larger one is dropped with its connection")
    p.add_argument("--tenant")
    p.add_argument("--model")
    p.add_argument("--preset", help="catalogue model for the namespace's spec")
    p.add_argument("--kv_dtype", help="bf16, fp16, fp8 or int8")
    p.add_argument("--page_size_tokens", type=int, help="tokens per kvcm page (0: the "
                   "engine's block size)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE,...",
                   help="an engine: id, kind (vllm or sglang), endpoint, endpoint_mode, "
                        "replay_endpoint, topic, token_file, token_env, data_parallel_rank, "
                        "block_size, kv_group, lora_by_name, require_extra_keys, "
                        "curve_secret_key_file, curve_publisher_keys_dir")
    p.add_argument("--log_level", default="INFO")
    return p


def from_args(argv: list[str] | None = None,
              prog: str = PROG) -> tuple[BridgeConfig, argparse.Namespace]:
    import sys

    argv = _cli.rename_flags(sys.argv[1:] if argv is None else argv, _FLAG_ALIASES, prog)
    args = arg_parser(prog).parse_args(argv)
    cfg = load(args.config)
    for name in ("manager_address", "insecure", "tls_ca_file", "tls_cert_file",
                 "tls_key_file", "register_token_file", "metrics_address", "ttl_ms",
                 "engine_timeout_s", "probe_interval_s", "replay_timeout_s",
                 "max_frame_bytes"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    if args.metrics_port is not None:
        _cli.warn_deprecated(prog, "--metrics_port", "--metrics_address host:port")
        cfg.metrics_address = _metrics_address(args.metrics_address or "", args.metrics_port)
    for name in ("tenant", "model", "preset", "kv_dtype", "page_size_tokens"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg.namespace, name, v)
    cfg.engines += [parse_engine_flag(t) for t in args.engine]
    cfg.validate()
    return cfg, args
