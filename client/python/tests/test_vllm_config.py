"""kvcm-vllm-bridge configuration: TOML, flags, and the errors that name the setting."""

import pytest

from kvcm.types import AttentionKind, KvDtype
from kvcm.engines.bridge import main
from kvcm.engines.config import ConfigError, from_args

TOML = """
manager_address = "kvcm:50051"
insecure = true
engine_timeout_s = 20

[namespace]
tenant = "acme"
model = "llama-3-8b"
preset = "llama-3-8b"
page_size_tokens = 32

[[engine]]
id = "vllm-0"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
token_file = "{token}"
block_size = 16

[[engine]]
id = "vllm-1"
endpoint = "tcp://127.0.0.1:6000"
endpoint_mode = "bind"
token_env = "VLLM1_TOKEN"
data_parallel_rank = 1
block_size = 16
"""


def write(tmp_path, text, **fmt):
    p = tmp_path / "bridge.toml"
    p.write_text(text.format(**fmt) if fmt else text)
    return str(p)


def test_toml_and_flags(tmp_path, monkeypatch):
    token = tmp_path / "t"
    token.write_text("secret-token-0123456789\n")
    monkeypatch.setenv("VLLM1_TOKEN", "env-token-0123456789")
    path = write(tmp_path, TOML, token=token)
    cfg, _ = from_args(["--config", path, "--manager_address", "other:1", "--engine_timeout_s", "9",
                        "--engine", "id=vllm-2,endpoint=tcp://h:7000,block_size=32"])
    assert cfg.manager_address == "other:1" and cfg.engine_timeout_s == 9 and cfg.insecure
    e0, e1, e2 = cfg.engines
    assert e0.resolve_token() == "secret-token-0123456789"
    assert e1.resolve_token() == "env-token-0123456789" and e1.data_parallel_rank == 1
    assert (e2.block_size, e2.endpoint_mode) == (32, "connect")
    spec = cfg.namespace.model_spec(16)
    assert spec.attention == AttentionKind.GQA and spec.page_size_tokens == 32
    assert spec.dtype == KvDtype.BF16


def test_explicit_spec(tmp_path):
    text = TOML.replace('preset = "llama-3-8b"\n', "").replace(
        "page_size_tokens = 32", 'page_size_tokens = 32\n[namespace.spec]\nattention = "mla"\n'
        'num_layers = 61\nnum_heads = 128\nkv_lora_rank = 512\nrope_dim = 64')
    cfg, _ = from_args(["--config", write(tmp_path, text.replace("token_file", "token")
                                          .replace("token_env", "token"),
                                          token="tok-0123456789abcdef")])
    spec = cfg.namespace.model_spec(16)
    assert spec.attention == AttentionKind.MLA and spec.kv_lora_rank == 512


@pytest.mark.parametrize("bad, message", [
    ('id = "vllm-0"', "engine ids repeat"),
    ('endpoint = "tcp://10.0.0.5:5557"', "cannot connect to 'tcp://\\*:6000'"),
    ("page_size_tokens = 32", "page size 24 tokens is not a multiple of the engine's block size 16"),
    ('preset = "llama-3-8b"', "no model 'nope'"),
    ("engine_timeout_s = 20", "unknown setting 'engine_timeuot_s'"),
    ('replay_endpoint = "tcp://10.0.0.5:5558"', "replay_endpoint 'tcp://\\*:5558'"),
])
def test_errors_name_the_setting(tmp_path, bad, message):
    good = {
        'id = "vllm-0"': 'id = "vllm-1"',
        'endpoint = "tcp://10.0.0.5:5557"': 'endpoint = "tcp://*:6000"',
        "page_size_tokens = 32": "page_size_tokens = 24",
        'preset = "llama-3-8b"': 'preset = "nope"',
        "engine_timeout_s = 20": "engine_timeuot_s = 20",
        'replay_endpoint = "tcp://10.0.0.5:5558"': 'replay_endpoint = "tcp://*:5558"',
    }[bad]
    text = TOML.replace(bad, good, 1)
    with pytest.raises(ConfigError, match=message):
        from_args(["--config", write(tmp_path, text, token="x")])


def test_no_token_on_the_command_line():
    with pytest.raises(ConfigError, match="no token on the command line"):
        from_args(["--insecure", "--tenant", "a", "--model", "m", "--preset", "llama-3-8b",
                   "--engine", "id=e,endpoint=tcp://h:1,token=abc"])


def test_main_reports_config_errors(capsys):
    assert main(["--insecure"]) == 2
    assert "no engine" in capsys.readouterr().err


BIND = ["--insecure", "--tenant", "a", "--model", "m", "--preset", "llama-3-8b"]


@pytest.mark.parametrize("endpoint", ["tcp://*:6000", "tcp://0.0.0.0:6000",
                                      "tcp://10.0.0.5:6000", "tcp://[::]:6000"])
def test_bind_beyond_loopback_needs_curve(endpoint):
    with pytest.raises(ConfigError, match="bind a loopback address .* or give "
                                          "curve_secret_key_file"):
        from_args(BIND + ["--engine", f"id=e,endpoint={endpoint},endpoint_mode=bind"])


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:6000", "tcp://[::1]:6000",
                                      "tcp://localhost:6000", "ipc:///tmp/kvcm-e.sock"])
def test_bind_on_loopback_needs_no_curve(endpoint):
    cfg, _ = from_args(BIND + ["--engine", f"id=e,endpoint={endpoint},endpoint_mode=bind"])
    assert not cfg.engines[0].curve and cfg.max_frame_bytes == 16 << 20


def test_curve_keys_are_checked_at_start(tmp_path):
    import zmq.auth

    keys, pubs = tmp_path / "keys", tmp_path / "publishers"
    keys.mkdir()
    pubs.mkdir()
    public, secret = zmq.auth.create_certificates(str(keys), "bridge")
    engine = "id=e,endpoint=tcp://*:6000,endpoint_mode=bind,curve_secret_key_file={},"\
             "curve_publisher_keys_dir=" + str(pubs)
    with pytest.raises(ConfigError, match="holds no \\*.key certificate"):
        from_args(BIND + ["--engine", engine.format(secret)])
    zmq.auth.create_certificates(str(pubs), "vllm-0")
    with pytest.raises(ConfigError, match="holds no secret key"):
        from_args(BIND + ["--engine", engine.format(public)])
    cfg, _ = from_args(BIND + ["--engine", engine.format(secret), "--max_frame_bytes", "65536"])
    assert cfg.engines[0].curve and cfg.max_frame_bytes == 65536
    with pytest.raises(ConfigError, match="needs both"):
        from_args(BIND + ["--engine", f"id=e,endpoint=tcp://*:6000,endpoint_mode=bind,"
                                      f"curve_secret_key_file={secret}"])
    with pytest.raises(ConfigError, match="CURVE keys are for endpoint_mode"):
        from_args(BIND + ["--engine", f"id=e,endpoint=tcp://h:6000,curve_secret_key_file="
                                      f"{secret},curve_publisher_keys_dir={pubs}"])
    with pytest.raises(ConfigError, match="max_frame_bytes"):
        from_args(BIND + ["--engine", engine.format(secret), "--max_frame_bytes", "10"])
