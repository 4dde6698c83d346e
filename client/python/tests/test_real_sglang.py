"""kvcm-bridge (kind "sglang") against SGLang's own code: SGLang 0.5.23's UnifiedRadixCache
records KV events with its own hashing and its ZmqEventPublisher sends them over loopback
(rigs/sglang_publisher.py, run by SGLang's Python), a kvcm-bridge process mirrors them
into a kvcm-manager (TLS, an engine token). After every step the manager's engine pool must
equal what SGLang published: for each prompt, the pages whose blocks SGLang still holds.

SGLang comes from $KVCM_SGLANG_PYTHON (its environment's python). Without it the module skips,
unless KVCM_REQUIRE_SGLANG=1: then it fails. ctest runs it on its own (python_real_sglang_test);
python_client_test leaves it out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import grpc
import msgspec
import pytest

from kvcm import hashing
from kvcm._proto.v1 import cache_manager_pb2 as pb
from kvcm._proto.v1 import cache_manager_pb2_grpc as pb_grpc
from kvcm.engines.pagehash import hash_request
from kvcm.sglang.pagehash import chain_hashes

from conftest import binary, sglang_test_path
from rigs.manager import ManagerProcess, free_port
from rigs.sglang_source import HeldBlocks, SglangSource, tokens

pytestmark = pytest.mark.timeout(300)

SECRET = bytes(range(16))
TENANT, MODEL, ENGINE = "acme", "sglang-demo", "sglang-0"
PS = 4           # SGLang's --page-size: one engine block
K = 2            # engine blocks per kvcm page
ENGINE_TOKEN = "engine-token-sglang-0-0123456789"
ADMIN = "admin-token-ops-0123456789ab"
GPU = 1
SETTLE_S = 20.0


class Story:
    def __init__(self, workdir: Path, source: SglangSource, manager: ManagerProcess,
                 bridge: subprocess.Popen, metrics_port: int, ca: Path):
        self.source, self.manager, self.bridge = source, manager, bridge
        self.metrics_port, self.workdir = metrics_port, workdir
        self.held = HeldBlocks()
        self.prompts: list[tuple[list[int], str | None]] = []
        self.key = hashing.namespace_key(SECRET, TENANT, MODEL)
        self._channel = manager.channel()
        self._stub = pb_grpc.CacheManagerStub(self._channel)
        self._md = (("authorization", f"Bearer {ADMIN}"),)

    def command(self, op: str, **kw) -> list[dict]:
        """A command to SGLang; its events go into the oracle only when SGLang's cache made
        them (insert, evict, reset), not for hand-made input."""
        events = self.source.command(op, **kw).get("events", [])
        if op in ("insert", "evict", "reset"):
            self.held.apply(events)
            if op == "reset":
                self.prompts.clear()
        if op == "insert":
            self.prompts.append((kw["tokens"], kw.get("salt")))
        return events


    def want(self) -> tuple[list[int], set[bytes]]:
        per_prompt, pages = [], set()
        for toks, salt in self.prompts:
            n = self.held.leading(chain_hashes(toks, PS, salt)) // K
            hashes = hash_request(self.key, toks, K * PS, PS, cache_salt=salt)[:n]
            per_prompt.append(n)
            pages.update(hashes)
        return per_prompt, pages

    def have(self) -> tuple[list[int], int]:
        per_prompt = []
        for toks, salt in self.prompts:
            req = pb.MatchRequest(probe=True)
            req.namespace.tenant, req.namespace.model = TENANT, MODEL
            req.prompt.page_hashes = b"".join(
                hash_request(self.key, toks, K * PS, PS, cache_salt=salt))
            req.prompt.scheme.version = 1
            req.prompt.scheme.page_size_tokens = K * PS
            req.prompt.scheme.key_fingerprint = hashing.key_fingerprint(self.key)
            try:
                resp = self._stub.Match(req, metadata=self._md, timeout=5)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                per_prompt.append(0)
                continue
            n = 0
            for seg in resp.segments:
                if seg.first_page != n or not any(r.pool.agent_id == ENGINE and
                                                  r.pool.tier == GPU for r in seg.replicas):
                    break
                n += seg.num_pages
            per_prompt.append(n)
        st = self._stub.Stats(pb.StatsRequest(), metadata=self._md, timeout=5)
        pool = sum(p.pages for p in st.pools
                   if p.pool.agent_id == ENGINE and p.pool.tier == GPU)
        return per_prompt, pool

    def settle(self) -> None:
        """Waits until the manager holds exactly what SGLang published."""
        want_prompts, want_pages = self.want()
        deadline = time.monotonic() + SETTLE_S
        have = None
        while time.monotonic() < deadline:
            have = self.have()
            if have == (want_prompts, len(want_pages)):
                return
            time.sleep(0.1)
        raise AssertionError(f"manager has {have}, SGLang published "
                             f"{(want_prompts, len(want_pages))}\n{self.bridge_log()}")

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        sel = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
        total = 0.0
        pattern = rf'^kvcm_vllm_bridge_{name}(?:_total)?{{{sel}[^}}]*}} (\S+)$'
        for m in re.finditer(pattern, text, re.M):
            total += float(m.group(1))
        return total

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        deadline = time.monotonic() + SETTLE_S
        v = 0.0
        while time.monotonic() < deadline:
            v = self.metric(name, **labels)
            if v >= at_least:
                return v
            time.sleep(0.2)
        raise AssertionError(f"{name}{labels} = {v} < {at_least}\n{self.bridge_log()}")

    def bridge_log(self) -> str:
        return (self.workdir / "bridge.log").read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> Iterator[Story]:
    python = sglang_test_path("KVCM_SGLANG_PYTHON", "the python of an SGLang environment")
    manager_bin = binary("KVCM_MANAGER_BIN", "kvcm-manager")
    workdir = tmp_path_factory.mktemp("real_sglang")
    certs = workdir / "certs"
    script = Path(os.environ.get("KVCM_SOURCE_ROOT") or Path(__file__).resolve().parents[3])
    subprocess.run([str(script / "scripts" / "make_test_certs.sh"), str(certs)], check=True,
                   capture_output=True)
    manager = ManagerProcess(
        manager_bin, workdir / "manager", secret=SECRET,
        tokens={ENGINE_TOKEN: f"{ENGINE} roles=engine engine={ENGINE} tenant={TENANT}",
                ADMIN: "ops roles=admin"},
        tls=(str(certs / "manager.pem"), str(certs / "manager.key"), str(certs / "ca.pem")))
    manager.start()
    source = SglangSource(python, PS, workdir / "sglang.log")
    (workdir / "engine.token").write_text(ENGINE_TOKEN + "\n")
    metrics_port = free_port()
    config = workdir / "bridge.toml"
    config.write_text(
        f'manager_address = "{manager.address}"\ntls_ca_file = "{certs / "ca.pem"}"\n'
        f'tls_cert_file = "{certs / "client.pem"}"\ntls_key_file = "{certs / "client.key"}"\n'
        f'metrics_address = "127.0.0.1:{metrics_port}"\nttl_ms = 3000\n'
        "engine_timeout_s = 5\nprobe_interval_s = 1\nreplay_timeout_s = 2\n"
        f'\n[namespace]\ntenant = "{TENANT}"\nmodel = "{MODEL}"\npreset = "llama-3-8b"\n'
        f"page_size_tokens = {K * PS}\n"
        f'\n[[engine]]\nid = "{ENGINE}"\nkind = "sglang"\nendpoint = "{source.endpoint}"\n'
        f'replay_endpoint = "{source.replay_endpoint}"\ntopic = "{source.topic}"\n'
        f'token_file = "{workdir / "engine.token"}"\nblock_size = {PS}\n')
    with open(workdir / "bridge.log", "ab") as log:
        bridge = subprocess.Popen([sys.executable, "-m", "kvcm.engines.bridge", "--config",
                                   str(config)], stdout=log, stderr=subprocess.STDOUT)
    s = Story(workdir, source, manager, bridge, metrics_port, certs / "ca.pem")
    try:
        yield s
    finally:
        bridge.terminate()
        try:
            bridge.wait(10)
        except subprocess.TimeoutExpired:
            bridge.kill()
            bridge.wait()
        source.close()
        manager.kill()


A = tokens(1, 6 * PS)
B = A[:2 * PS] + tokens(2, 3 * PS)  # one kvcm page shared with A


def test_stores_mirror_sglangs_blocks_with_its_hashes(story):
    for toks, salt in ((A, None), (B, None), (A, "salt-1")):
        events = story.command("insert", tokens=toks, salt=salt)
        stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        chain = chain_hashes(toks, PS, salt)
        assert stored and stored == chain[len(chain) - len(stored):]
    story.settle()
    assert story.have()[0] == [3, 2, 3]
    story.wait_metric("blocks_stored", 11)  # the snapshot behind /metrics is 1 s old at most
    assert story.metric("refused_blocks") == 0


def test_evictions_leave_the_pool(story):
    story.command("evict", num_tokens=2 * PS)
    story.settle()
    story.command("insert", tokens=tokens(3, 4 * PS))
    story.settle()


def test_bad_input_is_counted_and_changes_nothing(story):
    before = story.have()
    story.command("raw", payload_hex=b"\xc1 not msgpack".hex())
    story.wait_metric("bad_payloads", 1)
    plain = chain_hashes(tokens(9, PS), PS)
    # A block of the wrong size, and one whose hash is not SGLang's hash of its tokens.
    story.command("struct", events=[
        {"type": "BlockStored", "block_hashes": [plain[0]], "parent_block_hash": None,
         "token_ids": tokens(9, PS - 1), "block_size": PS - 1, "lora_id": None},
        {"type": "BlockStored", "block_hashes": [plain[0] ^ 1], "parent_block_hash": None,
         "token_ids": tokens(9, PS), "block_size": PS, "lora_id": None}])
    story.wait_metric("refused_blocks", 1, reason="block_size")
    story.wait_metric("refused_blocks", 1, reason="hash_mismatch")
    # A field SGLang 0.5.23 does not send, on a block it holds: counted, nothing new.
    held = chain_hashes(A, PS, "salt-1")[0]
    story.command("raw", payload_hex=msgspec.msgpack.encode([time.time(), [
        {"type": "BlockStored", "block_hashes": [held], "parent_block_hash": None,
         "token_ids": A[:PS], "block_size": PS, "lora_id": None, "medium": "GPU",
         "cache_salt": "salt-1", "future_field": 1}], 0]).hex())
    story.wait_metric("unknown_fields", 1, field="future_field")
    story.settle()
    assert story.have() == before


def test_a_sequence_gap_is_repaired_from_sglangs_replay(story):
    lost, resyncs = story.metric("lost_batches"), story.metric("resyncs")
    story.command("skip_seq")  # as when SGLang's publisher fails to encode a batch
    story.command("insert", tokens=tokens(4, 4 * PS))
    # Seen by the live stream or by a liveness probe, whichever comes first; the seq is in
    # no replay: the bridge resyncs from SGLang's buffer, and counts it lost.
    story.wait_metric("lost_batches", lost + 1)
    story.settle()
    assert story.metric("resyncs") >= resyncs + 1
    story.command("reset")
    story.command("insert", tokens=tokens(5, 2 * PS))
    story.settle()
    assert story.have()[1] == 1
