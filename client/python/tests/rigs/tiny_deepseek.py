"""A tiny DeepSeek-V2 (MLA) model directory that a real vLLM (CPU build) can serve:

    python -m rigs.tiny_deepseek DIR      # from client/python/tests

DeepSeek-V2's architecture at toy size: 2 layers, hidden 256, 4 heads, q_lora_rank null,
qk_nope_head_dim 32, v_head_dim 32, and the latent widths of the real model (kv_lora_rank
512, qk_rope_head_dim 64: vLLM's CPU MLA decode kernel exists only for 576 / 512), so one
token of one layer caches a 576-wide latent. first_k_dense_replace is past the last layer:
no MoE layer is built. The tokenizer is rigs.tiny_llama's ("0".."999" are token ids
0..999). Without weights, serve it with `--load-format dummy`; write_with_weights adds
random real ones (tiny_llama_weights.py) so the text depends on the KV. Standard library
only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rigs import tiny_llama

NUM_LAYERS = 2
KV_LORA_RANK = 512
ROPE_DIM = 64
# vLLM's CPU MLA backend works in blocks of 16 tokens.
BLOCK_SIZE = 16


def config() -> dict:
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": KV_LORA_RANK,
        "q_lora_rank": None,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "head_dim": ROPE_DIM,
        # No MoE layer (first_k_dense_replace >= layers); the MoE fields still need values.
        "first_k_dense_replace": 100,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "vocab_size": tiny_llama.VOCAB_SIZE,
        "bos_token_id": tiny_llama.BOS_ID,
        "eos_token_id": tiny_llama.EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write(directory: str | Path) -> Path:
    """Writes the model directory (made if missing); returns it."""
    d = tiny_llama.write(directory)
    (d / "config.json").write_text(json.dumps(config(), indent=1) + "\n")
    return d


def write_with_weights(directory: str | Path, python: str, timeout_s: float = 300) -> Path:
    """write() plus random real weights, made by `python` (an environment with torch,
    transformers and safetensors, e.g. vLLM's)."""
    return tiny_llama.add_weights(write(directory), python, timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rigs.tiny_deepseek DIR", file=sys.stderr)
        return 2
    print(write(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
