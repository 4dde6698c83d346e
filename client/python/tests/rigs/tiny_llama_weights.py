"""Random weights for a tiny model directory (rigs.tiny_llama's, or
tiny_deepseek's: any architecture transformers knows from its config.json), large enough
that the text it writes depends on its context (vLLM's --load-format dummy gives a uniform
next-token distribution whatever the KV). Runs in the vLLM environment (torch,
transformers, safetensors):

    python tiny_llama_weights.py MODEL_DIR        # writes MODEL_DIR/model.safetensors
"""

import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def main(model_dir: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # norms stay 1
                p.normal_(0.0, 0.5 if ("embed" in name or "lm_head" in name) else 0.15)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, f"{model_dir}/model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1])
