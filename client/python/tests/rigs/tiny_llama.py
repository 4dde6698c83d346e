"""A tiny Llama model directory that a real vLLM can serve without a model hub:

    python tiny_llama.py DIR      # or python -m rigs.tiny_llama DIR from client/python/tests

config.json (2 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, vocab 1024),
tokenizer.json (a `tokenizers` WordLevel model: the words "0".."999" are token ids 0..999, split
on whitespace), tokenizer_config.json (with a chat template) and generation_config.json. There
are no weights: serve it with `--load-format dummy` (random weights), so the text it writes is
noise, but its KV cache, prefix caching and KV events are vLLM's own. Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

VOCAB_SIZE = 1024
WORDS = 1000  # "0".."999" are token ids 0..999
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL = [BOS, EOS, UNK, PAD]  # ids 1000..1003; then <extra_N> up to VOCAB_SIZE
BOS_ID, EOS_ID = WORDS, WORDS + 1

# Each message's content, then a space: a prompt of words "1 2 3" stays those token ids.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def vocab() -> dict[str, int]:
    words = [str(i) for i in range(WORDS)] + SPECIAL
    words += [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(words))]
    return {w: i for i, w in enumerate(words)}


def tokenizer() -> dict:
    """tokenizer.json as the `tokenizers` library reads it (its serialized form)."""
    added = [{"id": WORDS + i, "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, t in enumerate(SPECIAL)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab(), "unk_token": UNK},
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def write(directory: str | Path, **overrides: int) -> Path:
    """Writes the model directory (made if missing); returns it. `overrides` replace
    config.json entries (e.g. num_hidden_layers=8 for a model whose prefill dominates)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {"config.json": {**config(), **overrides}, "tokenizer.json": tokenizer(),
             "tokenizer_config.json": tokenizer_config(),
             "generation_config.json": generation_config()}
    for name, content in files.items():
        (d / name).write_text(json.dumps(content, indent=1) + "\n")
    return d


def write_with_weights(directory: str | Path, python: str, timeout_s: float = 300) -> Path:
    """write() plus random real weights (tiny_llama_weights.py, run by `python`: an
    environment with torch, transformers and safetensors, e.g. vLLM's), so that the text
    the model writes depends on its KV (vLLM's dummy weights' does not)."""
    return add_weights(write(directory), python, timeout_s)


def add_weights(d: Path, python: str, timeout_s: float = 300) -> Path:
    """Random real weights for the model directory `d` (any architecture transformers knows
    from its config.json: tiny_llama_weights.py, run by `python`)."""
    weights = Path(__file__).with_name("tiny_llama_weights.py")
    subprocess.run([python, str(weights), str(d)], check=True, timeout=timeout_s)
    return d


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tiny_llama.py DIR", file=sys.stderr)
        return 2
    print(write(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
