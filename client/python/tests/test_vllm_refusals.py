"""Shapes the vLLM connector would get wrong without an error are refused before anything
is registered (issue 34: never wrong bytes): pipeline parallelism, a KV cache off the CPU;
and the shapes it handles get the right namespace spec: an MLA model (the latent, as kvcm's
catalogue counts it) and tensor parallelism (one page set per rank for GQA, one for MLA).
Checked against vLLM's own config objects (EngineArgs.create_engine_config, vLLM 0.32 CPU
build, $KVCM_VLLM_PYTHON) for a tiny Llama (TP 1 and 2), a tiny DeepSeek-V2 (MLA) and a
DeepSeek-V3-shaped config, and a real torch tensor on the meta device. vLLM's default
kv_load_failure_policy ("fail") gets a loud warning. Skips without the vLLM environment
unless KVCM_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import kvcm_pythonpath, vllm_test_path

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from vllm.engine.arg_utils import EngineArgs
from kvcm.testing import tiny_deepseek, tiny_llama
from vllm.config import KVTransferConfig
from kvcm.vllm.connector import (ConnectorOptions, load_failure_warning, model_spec_of,
                                 shards_of, unsupported_kv_cache, unsupported_reason)

work = Path(sys.argv[1])
llama = tiny_llama.write(work / "llama")
mla = tiny_deepseek.write(work / "mla")
v3 = tiny_deepseek.write(work / "v3")
config = json.loads((v3 / "config.json").read_text())
config.update({"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "qk_nope_head_dim": 128, "v_head_dim": 128})  # DeepSeek-V3's attention
(v3 / "config.json").write_text(json.dumps(config))

def engine_config(model, **kw):
    return EngineArgs(model=str(model), block_size=16, dtype="bfloat16", load_format="dummy",
                      **kw).create_engine_config()

def shards(cfg, **extra):
    opts = ConnectorOptions.from_extra({"manager_address": "m:1", "agent_id": "g0",
                                        "agent_address": "a:1", **extra}, "m")
    return [[str(s.namespace), s.agent_id, s.agent_address] for s in shards_of(opts, cfg)]

out = {}
cfg = engine_config(llama)
out["tp1"], out["tp1_spec"], out["tp1_shards"] = (unsupported_reason(cfg),
                                                  str(model_spec_of(cfg)), shards(cfg))
cfg = engine_config(llama, tensor_parallel_size=2)
out["tp2"], out["tp2_spec"] = unsupported_reason(cfg), str(model_spec_of(cfg))
out["tp2_shards"] = shards(cfg, agent_id=["g0", "g1"], agent_address=["a:1", "a:2"])
out["tp2_one_agent"] = shards(cfg)
try:
    shards(cfg, agent_id=["g0", "g1", "g2"])
    out["tp2_three_agents"] = None
except ValueError as e:
    out["tp2_three_agents"] = str(e)
out["pp2"] = unsupported_reason(engine_config(llama, pipeline_parallel_size=2))
cfg = engine_config(mla)
out["mla"], out["mla_spec"] = unsupported_reason(cfg), model_spec_of(cfg).__dict__
cfg = engine_config(mla, tensor_parallel_size=2)
out["mla_tp2_shards"] = shards(cfg, agent_id=["g0", "g1"], agent_address=["a:1", "a:2"])
out["v3_spec"] = {k: int(v) for k, v in model_spec_of(engine_config(v3)).__dict__.items()
                  if isinstance(v, int)}
out["meta"] = unsupported_kv_cache([("layers.0", torch.empty(2, 3, device="meta"))])
out["cpu"] = unsupported_kv_cache([("layers.0", torch.empty(2, 3))])
def policy(**kw):
    return load_failure_warning(KVTransferConfig(kv_connector="KvcmConnector",
                                                 kv_role="kv_both", **kw))
out["policy_default"] = policy()
out["policy_recompute"] = policy(kv_load_failure_policy="recompute")
print("RESULT " + json.dumps(out))
"""


def test_unsupported_shapes_are_refused_before_anything_is_registered(tmp_path) -> None:
    python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    env = dict(os.environ, PYTHONPATH=str(kvcm_pythonpath(tmp_path)))
    run = subprocess.run([python, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    # Supported shapes pass, with the spec vLLM's config gives.
    assert got["tp1"] is None and "GQA" in got["tp1_spec"]
    assert got["tp1_shards"] == [["default/m", "g0", "a:1"]]
    # GQA at TP=2: one rank's shard (2 of 4 heads, 1 of 2 KV heads) per namespace and agent.
    assert got["tp2"] is None
    assert "num_heads=2" in got["tp2_spec"] and "num_kv_heads=1" in got["tp2_spec"]
    assert got["tp2_shards"] == [["default/m/tp2-rank0", "g0", "a:1"],
                                 ["default/m/tp2-rank1", "g1", "a:2"]]
    assert got["tp2_one_agent"] == [["default/m/tp2-rank0", "g0", "a:1"],
                                    ["default/m/tp2-rank1", "g0", "a:1"]]
    assert "agent_id has 3 values" in got["tp2_three_agents"]
    # MLA: the latent, one page set for every rank (rank 0's agent).
    assert got["mla"] is None
    spec = got["mla_spec"]
    assert (spec["attention"], spec["kv_lora_rank"], spec["rope_dim"], spec["num_layers"],
            spec["num_kv_heads"], spec["head_dim"]) == (4, 512, 64, 2, 0, 0)
    assert got["mla_tp2_shards"] == [["default/m", "g0", "a:1"]]
    # A DeepSeek-V3-shaped config gives exactly kvcm's catalogue entry (page size aside), so
    # a namespace registered from the catalogue accepts the engine.
    v3 = {"attention": 4, "num_layers": 61, "num_heads": 128, "num_kv_heads": 0,
          "head_dim": 0, "kv_lora_rank": 512, "rope_dim": 64, "dtype": 1,
          "page_size_tokens": 16, "qk_nope_head_dim": 128, "v_head_dim": 128}
    assert {k: got["v3_spec"][k] for k in v3} == v3
    # Each unsupported shape is refused, naming what is wrong.
    assert "pipeline_parallel_size 2" in got["pp2"]
    assert "is on meta" in got["meta"]
    assert got["cpu"] is None
    # vLLM's default kv_load_failure_policy ("fail") is warned about loudly at start.
    assert got["policy_recompute"] is None
    assert 'kv_load_failure_policy is "fail"' in got["policy_default"]


LAYOUTS = r"""
import json
import torch
from kvcm.vllm.connector import block_views

B, N, H, D = 6, 16, 2, 64  # blocks, tokens per block, KV heads, head dim
bf16 = torch.bfloat16

def layers(make):
    return [(f"model.layers.{i}.self_attn.attn", make()) for i in range(2)]

def describe(kv, num_blocks=B, backend="X"):
    try:
        views, layout = block_views(kv, num_blocks, backend)
    except ValueError as e:
        return {"error": str(e)}
    # Block 3's bytes as the views give them, against the bytes written there.
    return {"layout": layout, "block": [list(v.shape) for _, v in views][0],
            "raw": all(bool(torch.equal(v[3].reshape(-1), marks[name])) for name, v in views)}

out, marks = {}, {}

# vLLM's CPU backend: [blocks, KV heads, tokens, K||V], blocks contiguous.
def cpu():
    return torch.randn(B, H, N, 2 * D).to(bf16)
kv = layers(cpu)
for name, t in kv:
    marks[name] = t[3].reshape(-1).clone()
out["cpu"] = describe(kv, backend="CPU_ATTN")
# The same logical [B, H, N, C] view over token-major memory (LBNHC: NHD inside a block).
def nhd():
    return torch.randn(B, N, H, 2 * D).to(bf16).permute(0, 2, 1, 3)
kv = layers(nhd)
for name, t in kv:
    marks[name] = t.permute(0, 2, 1, 3)[3].reshape(-1).clone()  # memory order
out["nhd"] = describe(kv, backend="CPU_ATTN")
# FlashInfer: [blocks, 2 (K, V), tokens, heads, dim]: a block is one run.
def flashinfer():
    return torch.randn(B, 2, N, H, D).to(bf16)
kv = layers(flashinfer)
for name, t in kv:
    marks[name] = t[3].reshape(-1).clone()
out["flashinfer"] = describe(kv, backend="FLASHINFER")
# FlashAttention: [2 (K, V), blocks, tokens, heads, dim]: K and V of a block apart.
out["flash_attn"] = describe(layers(lambda: torch.randn(2, B, N, H, D).to(bf16)),
                             backend="FLASH_ATTN")
# Kernel blocks: each vLLM block of 16 tokens is two kernel blocks of 8.
def kernel():
    return torch.randn(2 * B, H, N // 2, 2 * D).to(bf16)
kv = layers(kernel)
for name, t in kv:
    marks[name] = t.unflatten(0, (B, 2))[3].reshape(-1).clone()
out["kernel"] = describe(kv, backend="CPU_ATTN")
# Block-outermost (BLHNC): a block holds every layer's page; each layer's view strides over
# the other layers' pages, but its own block is one run.
raw = torch.randn(B, 2, H, N, 2 * D).to(bf16)
kv = [(f"model.layers.{i}.self_attn.attn", raw[:, i]) for i in range(2)]
for name, t in kv:
    marks[name] = t[3].reshape(-1).clone()
out["block_outermost"] = describe(kv, backend="CPU_ATTN")
# MLA: [blocks, 1, tokens, 576].
kv = layers(lambda: torch.randn(B, 1, N, 576).to(bf16))
for name, t in kv:
    marks[name] = t[3].reshape(-1).clone()
out["mla"] = describe(kv, backend="CPU_MLA")
# Layers that differ.
out["mixed"] = describe([("model.layers.0.a", cpu()), ("model.layers.1.a", flashinfer())])
print("RESULT " + json.dumps(out))
"""


def test_block_layouts_are_named_and_read_in_memory_order(tmp_path) -> None:
    """block_views on CPU tensors allocated in the layouts of vLLM's backends: a block that
    is one run of bytes is read in memory order and named by backend, dtype, shape and
    strides (so two layouts never share a namespace); a block split apart is refused."""
    python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    env = dict(os.environ, PYTHONPATH=str(kvcm_pythonpath(tmp_path)))
    run = subprocess.run([python, "-c", LAYOUTS], env=env, capture_output=True, text=True,
                         timeout=300)
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["cpu"] == {"layout": "vllm/CPU_ATTN:bf16:block[2,16,128]:stride[2048,128,1]",
                          "block": [6, 2, 16, 128], "raw": True}
    # NHD memory under the same logical shape: another layout, read in memory order.
    assert got["nhd"]["layout"] == "vllm/CPU_ATTN:bf16:block[2,16,128]:stride[128,256,1]"
    assert got["nhd"]["block"] == [6, 16, 2, 128] and got["nhd"]["raw"]
    assert got["flashinfer"]["layout"].startswith("vllm/FLASHINFER:bf16:block[2,16,2,64]")
    assert got["flashinfer"]["raw"]
    assert "not vLLM's 6 blocks" in got["flash_attn"]["error"]
    assert got["kernel"]["block"] == [6, 2, 2, 8, 128] and got["kernel"]["raw"]
    assert got["block_outermost"]["raw"]
    assert got["block_outermost"]["layout"] == got["cpu"]["layout"]  # same block bytes
    assert got["mla"]["layout"] == "vllm/CPU_MLA:bf16:block[1,16,576]:stride[9216,576,1]"
    assert "laid out unlike" in got["mixed"]["error"]
    layouts = {got[k]["layout"] for k in ("cpu", "nhd", "flashinfer", "kernel", "mla")}
    assert len(layouts) == 5
