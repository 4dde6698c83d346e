"""The console scripts' shared vocabulary (issue 26): --help, --version, deprecated flag and
TOML-key spellings that warn once, addresses, and a script installed without its extra."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

import pytest

from kvcm import _cli
from kvcm.engines.config import from_args as bridge_config
from kvcm.router.config import ConfigError, load_config

SCRIPTS = [("kvcm-router", "router_main"), ("kvcm-bridge", "bridge_main"),
           ("kvcm-vllm-bridge", "vllm_bridge_main")]


def run_script(entry: str, *args: str, block: str = "") -> subprocess.CompletedProcess:
    """Runs kvcm._cli.<entry> as its console script would, in a fresh interpreter; `block`
    names modules whose import fails (as if their package were not installed)."""
    code = ("import sys\n"
            f"for m in {block.split()!r}: sys.modules[m] = None\n"
            f"sys.argv = ['x', *{list(args)!r}]\n"
            f"from kvcm._cli import {entry}\n"
            f"sys.exit({entry}())\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, COLUMNS="100"))


@pytest.mark.parametrize("prog, entry", SCRIPTS)
def test_help_and_version_exit_0(prog: str, entry: str) -> None:
    done = run_script(entry, "--help")
    assert done.returncode == 0, done.stderr
    assert f"usage: {prog}" in done.stdout and "--manager_address" in done.stdout
    assert "--version" in done.stdout
    done = run_script(entry, "--version")
    assert done.returncode == 0, done.stderr
    from kvcm import __version__
    assert done.stdout.startswith(f"{prog} {__version__} (git "), done.stdout
    assert done.stdout.rstrip().endswith(")")


@pytest.mark.parametrize("entry, extra, block", [
    ("router_main", "router", "aiohttp"),
    ("router_main", "router", "prometheus_client"),
    ("bridge_main", "bridge", "zmq"),
    ("bridge_main", "bridge", "msgspec"),
    ("vllm_bridge_main", "bridge", "zmq"),
])
def test_a_script_without_its_extra_says_which_to_install(entry: str, extra: str,
                                                          block: str) -> None:
    prog = dict((e, p) for p, e in SCRIPTS)[entry]
    done = run_script(entry, "--insecure", block=block)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"{prog} needs the '{extra}' extra: from kvcm's source "
                                  f"tree, pip install './client/python[{extra}]'"), done.stderr
    assert "kvcm[" not in done.stderr  # kvcm is not on PyPI
    assert "Traceback" not in done.stderr
    # --version needs no extra.
    assert run_script(entry, "--version", block=block).returncode == 0


ROUTER = ["--policy", "kv-aware", "--tokenizer", "words", "--engine", "e0=http://h:1",
          "--insecure", "--tenant", "acme", "--model", "m", "--preset", "llama-3-8b"]


def test_router_listens_on_8100_by_default(monkeypatch) -> None:
    monkeypatch.delenv("KVCM_MANAGER_ADDRESS", raising=False)
    cfg = load_config([*ROUTER, "--manager_address", "kvcm:50051"])
    assert cfg.listen_address == "127.0.0.1:8100" and cfg.listen_host_port[1] == 8100


def test_manager_address_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVCM_MANAGER_ADDRESS", "env-manager:50051")
    assert load_config(ROUTER).manager_address == "env-manager:50051"
    assert load_config([*ROUTER, "--manager_address", "flag:1"]).manager_address == "flag:1"
    bridge = ["--insecure", "--tenant", "a", "--model", "m", "--preset", "llama-3-8b",
              "--engine", "id=e,endpoint=tcp://h:1"]
    assert bridge_config(bridge)[0].manager_address == "env-manager:50051"
    monkeypatch.delenv("KVCM_MANAGER_ADDRESS")
    assert bridge_config(bridge)[0].manager_address == "127.0.0.1:50051"
    with pytest.raises(ConfigError, match="manager_address: required by policy kv-aware"):
        load_config(ROUTER)


def test_cli_addresses_need_a_port() -> None:
    with pytest.raises(ConfigError, match="manager_address 'kvcm' has no port; the manager "
                                          "listens on 50051 by default: kvcm:50051"):
        load_config([*ROUTER, "--manager_address", "kvcm"])
    from kvcm.engines.config import ConfigError as BridgeConfigError
    bridge = ["--insecure", "--tenant", "a", "--model", "m", "--preset", "llama-3-8b",
              "--engine", "id=e,endpoint=tcp://h:1"]
    with pytest.raises(BridgeConfigError, match="manager_address 'kvcm' has no port"):
        bridge_config([*bridge, "--manager_address", "kvcm"])
    with pytest.raises(BridgeConfigError, match="metrics_address '0.0.0.0' has no port; "
                                                "kvcm-bridge's /metrics listens on 9466"):
        bridge_config([*bridge, "--metrics_address", "0.0.0.0"])


def warnings_of(err: str) -> List[str]:
    return [line for line in err.splitlines() if "deprecated" in line]


def test_deprecated_router_flags_and_keys_work_and_warn_once(tmp_path, capsys,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(_cli, "_warned", set())
    path = tmp_path / "router.toml"
    path.write_text('manager = "kvcm:50051"\nca_file = "/ca.pem"\nlisten = "0.0.0.0:9000"\n'
                    '[namespace]\ndtype = "fp8"\npage_size = 32\n')
    base = ["--policy", "kv-aware", "--tokenizer", "words", "--engine", "e0=http://h:1",
            "--tenant", "acme", "--model", "m", "--preset", "llama-3-8b", "--config", str(path)]
    cfg = load_config(base)
    assert (cfg.manager_address, cfg.tls_ca_file, cfg.listen_address) == (
        "kvcm:50051", "/ca.pem", "0.0.0.0:9000")
    assert (cfg.namespace.kv_dtype, cfg.namespace.page_size_tokens) == ("fp8", 32)
    err = capsys.readouterr().err
    assert len(warnings_of(err)) == 5, err
    assert "key 'manager' is deprecated; use 'manager_address'" in err
    load_config(base)
    assert warnings_of(capsys.readouterr().err) == []  # once per process
    cfg = load_config([*base, "--manager", "flag:1", "--listen=0.0.0.0:9001",
                       "--page-size", "48", "--dtype", "bf16", "--cert_file", "c",
                       "--key_file", "k"])
    assert (cfg.manager_address, cfg.listen_address, cfg.namespace.page_size_tokens,
            cfg.namespace.kv_dtype, cfg.tls_cert_file, cfg.tls_key_file) == (
        "flag:1", "0.0.0.0:9001", 48, "bf16", "c", "k")
    err = warnings_of(capsys.readouterr().err)
    assert "kvcm-router: --manager is deprecated; use --manager_address" in err
    assert "kvcm-router: --page-size is deprecated; use --page_size_tokens" in err
    assert len(err) == 6, err
    path.write_text('manager = "a:1"\nmanager_address = "b:1"\n')
    with pytest.raises(ConfigError, match="give manager_address, not also its deprecated"):
        load_config(base)


def test_deprecated_bridge_flags_and_keys_work_and_warn_once(tmp_path, capsys,
                                                             monkeypatch) -> None:
    monkeypatch.setattr(_cli, "_warned", set())
    path = tmp_path / "bridge.toml"
    path.write_text('manager = "kvcm:50051"\ninsecure = true\nmetrics_port = 9471\n'
                    '[namespace]\ntenant = "a"\nmodel = "m"\npreset = "llama-3-8b"\n'
                    'page_size = 32\ndtype = "fp8"\n'
                    '[[engine]]\nid = "e"\nendpoint = "tcp://h:1"\n')
    cfg, _ = bridge_config(["--config", str(path)])
    assert (cfg.manager_address, cfg.metrics_address) == ("kvcm:50051", "0.0.0.0:9471")
    assert (cfg.namespace.page_size_tokens, cfg.namespace.kv_dtype) == (32, "fp8")
    assert len(warnings_of(capsys.readouterr().err)) == 4
    cfg, _ = bridge_config(["--config", str(path), "--manager", "x:1", "--metrics_address",
                            "127.0.0.1", "--metrics_port", "9500", "--page_size", "16"])
    assert (cfg.manager_address, cfg.metrics_address, cfg.namespace.page_size_tokens) == (
        "x:1", "127.0.0.1:9500", 16)
    err = warnings_of(capsys.readouterr().err)
    assert sorted(err) == [
        "kvcm-bridge: --manager is deprecated; use --manager_address",
        "kvcm-bridge: --metrics_port is deprecated; use --metrics_address host:port",
        "kvcm-bridge: --page_size is deprecated; use --page_size_tokens"], err


def test_connector_extra_config_keys_rename_with_a_warning() -> None:
    logged: List[str] = []
    extra = {"manager_address": "m:1", "ca_file": "/ca", "cert_file": "/c", "key_file": "/k"}
    out = _cli.rename_keys(extra, {"ca_file": "tls_ca_file", "cert_file": "tls_cert_file",
                                   "key_file": "tls_key_file"},
                           "KvcmConnector", "kv_connector_extra_config", warn=logged.append)
    assert out == {"manager_address": "m:1", "tls_ca_file": "/ca", "tls_cert_file": "/c",
                   "tls_key_file": "/k"}
    assert logged[0] == ("KvcmConnector: kv_connector_extra_config: key 'ca_file' is "
                         "deprecated; use 'tls_ca_file'") and len(logged) == 3
