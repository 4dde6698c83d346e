"""Shapes the vLLM connector would get wrong without an error are refused before anything
is registered (issue 34: never wrong bytes): an MLA model, tensor parallelism, a KV cache off
the CPU. Checked against vLLM's own config objects (EngineArgs.create_engine_config, vLLM 0.32
CPU build, $KVCM_VLLM_PYTHON) for a tiny Llama (TP 1 and 2) and a tiny DeepSeek-V2 (MLA) whose
configs are written here, and a real torch tensor on the meta device. vLLM's default
kv_load_failure_policy ("fail") gets a loud warning. Skips without the vLLM environment unless
KVCM_REQUIRE_VLLM=1.
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
from kvcm.testing import tiny_llama
from vllm.config import KVTransferConfig
from kvcm.vllm.connector import (load_failure_warning, model_spec_of, unsupported_kv_cache,
                                 unsupported_reason)

work = Path(sys.argv[1])
llama = tiny_llama.write(work / "llama")
mla = tiny_llama.write(work / "mla")
config = json.loads((mla / "config.json").read_text())
config.update({  # DeepSeek-V2's shape, small; vLLM's CPU MLA kernel wants 512 + 64
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "first_k_dense_replace": 100, "n_routed_experts": 4, "moe_intermediate_size": 64,
    "n_shared_experts": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 2, "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "rope_scaling": None})
(mla / "config.json").write_text(json.dumps(config))

def reason(model, **kw):
    cfg = EngineArgs(model=str(model), block_size=16, dtype="bfloat16", load_format="dummy",
                     **kw).create_engine_config()
    return unsupported_reason(cfg), cfg

out = {}
out["tp1"], cfg = reason(llama)
out["tp1_spec"] = str(model_spec_of(cfg))
out["tp2"], _ = reason(llama, tensor_parallel_size=2)
out["mla"], _ = reason(mla)
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
    # The supported shape passes, with the GQA spec vLLM's config gives.
    assert got["tp1"] is None
    assert "gqa" in got["tp1_spec"].lower() or "GQA" in got["tp1_spec"]
    assert got["cpu"] is None
    # Each unsupported one is refused, naming what is wrong.
    assert "tensor_parallel_size 2" in got["tp2"] and "another rank's shard" in got["tp2"]
    assert "MLA models" in got["mla"] and "head size 576" in got["mla"]
    assert "is on meta" in got["meta"]
    # vLLM's default kv_load_failure_policy ("fail") is warned about loudly at start.
    assert got["policy_recompute"] is None
    assert 'kv_load_failure_policy is "fail"' in got["policy_default"]
