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
from pathlib import Path

import pytest
from conftest import kvcm_pythonpath, vllm_test_path

SCRIPT = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])  # the tests' folder, for the rigs (kvcm alone is on PYTHONPATH)
import torch
from vllm.engine.arg_utils import EngineArgs
from rigs import tiny_deepseek, tiny_llama
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
    run = subprocess.run([python, "-c", SCRIPT, str(tmp_path), str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=300)
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
import sys
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor, MLAAttentionSpec,
                                        compute_layout_strides)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache
from kvcm.vllm.layout import KvBlocks, block_views

device = torch.device(sys.argv[1])
B, L = 6, 2  # vLLM blocks, layers
bf16 = torch.bfloat16
SPECS = {"gqa": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=bf16),
         "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf16)}

def engine(spec, layout, kernel=None):
    # vLLM's own allocation (get_kv_cache_config_from_groups' strides, the model runner's
    # allocate_kv_cache): one buffer, every layer a [blocks, heads, tokens, content] view.
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    page = spec.page_size_bytes
    interleaved = page * L if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, B, L, layout, fixed_strides=(None, interleaved, None, None, None))
    config = KVCacheConfig(num_blocks=B, kv_cache_tensors=[KVCacheTensor(
        size=page * B * L, layers=names, layer_stride=layer_stride, block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kv = allocate_kv_cache(config, device, layout, [kernel] if kernel else None)
    for t in kv.values():
        t.copy_(torch.randn(t.shape).to(bf16))
    return sorted(kv.items())

def expected(kv, layout, block, kernel=1):
    # The oracle, from the layout's name alone: block b's elements in the order of the
    # letters after L and B (H, N, C), kernel blocks first.
    order = [" HNC".index(c) for c in layout.name if c in "HNC"]
    parts = []
    for _, t in kv:
        t = t.unflatten(0, (B, kernel))[block]
        parts.append(t.permute(0, *order).reshape(-1).view(torch.uint8))
    return torch.cat(parts).cpu()

out = {}
for kind, spec in SPECS.items():
    for layout in KVCacheLayout:
        for stage in (False, True):
            kv = engine(spec, layout)
            views, name = block_views(kv, B, "X")
            blocks = KvBlocks([v for _, v in views], stage=stage)
            got = blocks.gather([3, 1]).cpu()
            ok = (torch.equal(got[0], expected(kv, layout, 3))
                  and torch.equal(got[1], expected(kv, layout, 1)))
            # Into another engine of every layout: equal strings must mean equal KV.
            moved = {}
            for other in KVCacheLayout:
                kv2 = engine(spec, other)
                views2, name2 = block_views(kv2, B, "X")
                if name2 != name:
                    continue
                KvBlocks([v for _, v in views2], stage=stage).scatter(
                    [5, 0], got.numpy().tobytes())
                moved[other.name] = all(
                    torch.equal(a[3], b[5]) and torch.equal(a[1], b[0])
                    for (_, a), (_, b) in zip(kv, kv2))
            out[f"{kind}/{layout.name}/{int(stage)}"] = {
                "layout": name, "gather": ok, "moved": moved,
                "staged": blocks.staged}
# Kernel blocks: a vLLM block of 16 tokens as two kernel blocks of 8.
kv = engine(SPECS["gqa"], KVCacheLayout.LBHNC, kernel=8)
views, name = block_views(kv, B, "X")
got = KvBlocks([v for _, v in views]).gather([4]).cpu()
out["kernel"] = {"layout": name, "shape": list(views[0][1].shape),
                 "gather": torch.equal(got[0], expected(kv, KVCacheLayout.LBHNC, 4, 2))}
# Refusals: dim 0 that is not vLLM's blocks, and layers laid out unlike each other.
def refused(kv, num_blocks=B):
    try:
        block_views(kv, num_blocks, "X")
    except ValueError as e:
        return str(e)
odd = [(n, t[:5]) for n, t in engine(SPECS["gqa"], KVCacheLayout.LBHNC)]
out["not_blocks"] = refused(odd)
mixed = [engine(SPECS["gqa"], KVCacheLayout.LBHNC)[0], engine(SPECS["gqa"], KVCacheLayout.LBNHC)[1]]
out["mixed"] = refused(mixed)
# What the namespace records for each backend: the name is part of the layout.
out["backend"] = block_views(engine(SPECS["mla"], KVCacheLayout.LBHNC), B, "CPU_MLA")[1]
print("RESULT " + json.dumps(out))
"""


def _layouts(tmp_path, device: str) -> dict:
    python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    env = dict(os.environ, PYTHONPATH=str(kvcm_pythonpath(tmp_path)))
    run = subprocess.run([python, "-c", LAYOUTS, device], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_layouts(got: dict) -> None:
    for spec in ("gqa", "mla"):
        for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
            for stage in (0, 1):
                case = got[f"{spec}/{layout}/{stage}"]
                assert case["gather"], (spec, layout, stage)
                assert case["moved"] and all(case["moved"].values()), (spec, layout, case)
                assert case["staged"] == bool(stage) or got.get("device") == "cuda"
    # Within a block, heads then tokens (LBHNC, LHBNC, BLHNC, BHLNC) is one layout
    # whatever the strides across blocks and layers; tokens then heads (LBNHC, BLNHC) is
    # another, and neither loads the other's pages.
    hnc = {got[f"gqa/{l}/0"]["layout"] for l in ("LBHNC", "LHBNC", "BLHNC", "BHLNC")}
    nhc = {got[f"gqa/{l}/0"]["layout"] for l in ("LBNHC", "BLNHC")}
    assert hnc == {"vllm/X:bf16:block[2,16,128]:order[0,1,2]"}
    assert nhc == {"vllm/X:bf16:block[2,16,128]:order[1,0,2]"}
    assert set(got["gqa/LBHNC/0"]["moved"]) == {"LBHNC", "LHBNC", "BLHNC", "BHLNC"}
    # MLA has one latent "head": every layout lists a block's bytes alike.
    assert {got[f"mla/{l}/0"]["layout"] for l in ("LBHNC", "LBNHC", "BHLNC")} == {
        "vllm/X:bf16:block[1,16,576]:order[1,2]"}
    assert len(got["mla/LBNHC/0"]["moved"]) == 6
    assert got["kernel"]["gather"] and got["kernel"]["shape"] == [6, 2, 2, 8, 128]
    assert got["kernel"]["layout"] == "vllm/X:bf16:block[2,2,8,128]:order[0,1,2,3]"
    assert "not vLLM's 6 blocks" in got["not_blocks"]
    assert "laid out unlike" in got["mixed"]
    assert got["backend"] == "vllm/CPU_MLA:bf16:block[1,16,576]:order[1,2]"


def test_every_vllm_layout_moves_its_blocks_in_memory_order(tmp_path) -> None:
    """vLLM's own KV allocation (allocate_kv_cache) in each of its six KVCacheLayouts, for a
    GQA and an MLA spec, with and without kernel-block splitting, on CPU tensors: a block's
    bytes are its elements in memory order (checked against an oracle built from the
    layout's name), through the plain and the staged (pinned-host) path alike; a block
    moved into an engine whose layout string is equal holds the same KV there, and the
    strings differ exactly where the bytes would (so the namespace refuses the engine)."""
    _check_layouts(_layouts(tmp_path, "cpu"))


def test_every_vllm_layout_moves_its_blocks_on_a_gpu(tmp_path) -> None:
    """The same on a CUDA device (staged through pinned host memory). Runs only where the
    vLLM environment's torch sees a GPU: never in this project's CI so far."""
    python = vllm_test_path("KVCM_VLLM_PYTHON", "the vLLM environment's python")
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("no CUDA device visible to the vLLM environment's torch")
    got = _layouts(tmp_path, "cuda")
    got["device"] = "cuda"
    _check_layouts(got)
