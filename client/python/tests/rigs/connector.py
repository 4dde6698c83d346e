"""A kvcm-manager, kvcm-agents and real vLLM engines running kvcm's connector, for the
connector tests (test_vllm_mla.py, test_vllm_tp.py): each agent listens on loopback with a
--local_socket in the work directory and the geometry a test gives it; each engine gets
kvcm's --kv-transfer-config (kv_both, kv_load_failure_policy recompute) with the
kv_connector_extra_config a test gives it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvcm

from conftest import Process, kvcm_pythonpath, vllm_test_path, wait_registered
from rigs import tiny_deepseek
from rigs.manager import ManagerProcess, free_port
from rigs.vllm_engine import VllmEngine


# kvcm-agent's flags for the tiny DeepSeek's MLA geometry, as a user sizes an agent for it
# (the whole latent: it is not split across tensor-parallel ranks).
MLA_AGENT_FLAGS = [
    "--attention=mla", f"--num_layers={tiny_deepseek.NUM_LAYERS}", "--num_heads=4",
    f"--kv_lora_rank={tiny_deepseek.KV_LORA_RANK}", f"--rope_dim={tiny_deepseek.ROPE_DIM}",
    "--kv_dtype=bf16", f"--page_size_tokens={tiny_deepseek.BLOCK_SIZE}"]
# kvcm's MLA formula for it: (kv_lora_rank + rope_dim) x bf16 per token and layer.
MLA_BLOCK_BYTES = ((tiny_deepseek.KV_LORA_RANK + tiny_deepseek.ROPE_DIM) * 2
                   * tiny_deepseek.NUM_LAYERS * tiny_deepseek.BLOCK_SIZE)


def prompt(seed: int, blocks: int, block: int) -> list[int]:
    """`blocks` whole blocks plus 5 tokens (vLLM always computes the last one)."""
    return [(seed * 7919 + i * 31) % 1000 for i in range(blocks * block + 5)]


def text(body: dict) -> str:
    return body["choices"][0]["text"]


def logprobs(body: dict) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


class ConnectorCluster:
    def __init__(self, workdir: Path, manager_bin: str, agent_bin: str, vllm_python: str):
        self.workdir, self.agent_bin, self.python = workdir, agent_bin, vllm_python
        self.pythonpath = kvcm_pythonpath(workdir)
        self.manager = ManagerProcess(manager_bin, workdir / "manager")
        self.agents: dict[str, Process] = {}
        self.address: dict[str, str] = {}
        self.engines: dict[str, VllmEngine] = {}
        self.client: kvcm.Client | None = None

    @classmethod
    def from_env(cls, workdir: Path) -> "ConnectorCluster":
        """A cluster of this build's binaries and vLLM environment ($KVCM_MANAGER_BIN,
        $KVCM_AGENT_BIN, $KVCM_VLLM_PYTHON): the test skips without them, unless
        KVCM_REQUIRE_VLLM=1."""
        return cls(workdir, vllm_test_path("KVCM_MANAGER_BIN", "the kvcm-manager binary"),
                   vllm_test_path("KVCM_AGENT_BIN", "the kvcm-agent binary"),
                   vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python"))

    def start(self) -> "ConnectorCluster":
        self.manager.start()
        self.client = kvcm.Client(self.manager.address, insecure=True)
        return self

    def socket(self, agent_id: str) -> str:
        return str(self.workdir / f"{agent_id}.sock")

    def start_agents(self, agent_ids: list[str], geometry: list[str],
                     capacity_bytes: int) -> None:
        """Agents sized by `geometry` (kvcm-agent's --attention, --num_layers, ... flags), as
        a user sizes them for the engine; returns once the manager knows them all."""
        for agent_id in agent_ids:
            port = free_port()
            self.agents[agent_id] = Process(
                [self.agent_bin, "--insecure", f"--agent_id={agent_id}",
                 f"--manager_address={self.manager.address}",
                 f"--listen_address=127.0.0.1:{port}", "--use_device=false", "--model=",
                 *geometry, f"--capacity_bytes={capacity_bytes}",
                 "--heartbeat_interval_ms=200", f"--local_socket={self.socket(agent_id)}"],
                self.workdir / f"{agent_id}.log")
            self.address[agent_id] = f"127.0.0.1:{port}"
        assert self.client is not None
        wait_registered(self.client, {a: self.agents[a] for a in agent_ids})

    def rank_agents(self, agents: list[str], local: bool = False) -> dict[str, Any]:
        """kv_connector_extra_config naming one agent per tensor-parallel rank, in rank
        order (README's way), with their local sockets when `local`."""
        extra: dict[str, Any] = {"agent_id": agents,
                                 "agent_address": [self.address[a] for a in agents]}
        if local:
            extra["local_socket"] = [self.socket(a) for a in agents]
        return extra

    def engine(self, name: str, model_dir: Path, extra: dict[str, Any] | None,
               args: tuple[str, ...] = (), **engine_kwargs: Any) -> VllmEngine:
        """A vLLM server with random real weights (`--seed 0`); with `extra`, kvcm's
        connector configured by that kv_connector_extra_config (None: a plain engine)."""
        args = ("--seed", "0", "--load-format", "safetensors", *args)
        if extra is not None:
            args += ("--kv-transfer-config", json.dumps({
                "kv_connector": "KvcmConnector",
                "kv_connector_module_path": "kvcm.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"manager_address": self.manager.address,
                                              # 500 ms by default, sized for an idle host;
                                              # ctest runs engines side by side, where a
                                              # Match can take longer and a hit would
                                              # become a recompute. Tests of the deadline
                                              # set their own.
                                              "request_deadline_ms": 5_000,
                                              **extra}}))
        e = VllmEngine(self.workdir / name, python=self.python, extra_args=args,
                       model_dir=model_dir, extra_env={"PYTHONPATH": str(self.pythonpath)},
                       **engine_kwargs)
        self.engines[name] = e
        return e

    def start_engines(self, engines: list[VllmEngine]) -> None:
        for e in engines:  # they load at once
            e.launch()
        for e in engines:
            e.wait_healthy()

    def stop(self) -> None:
        for e in self.engines.values():
            e.stop()
        if self.client is not None:
            self.client.close()
        for agent in self.agents.values():
            agent.stop()
        self.manager.stop()
