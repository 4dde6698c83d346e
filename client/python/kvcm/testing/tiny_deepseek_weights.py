"""Random weights for kvcm.testing.tiny_deepseek's model directory (see
tiny_llama_weights.py for why vLLM's dummy weights do not do). Runs in the vLLM environment
(torch, transformers with DeepseekV2, safetensors):

    python tiny_deepseek_weights.py MODEL_DIR        # writes MODEL_DIR/model.safetensors
"""

import sys

import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM


def main(model_dir: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config.from_pretrained(model_dir))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # norms stay 1
                p.normal_(0.0, 0.5 if ("embed" in name or "lm_head" in name) else 0.15)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, f"{model_dir}/model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1])
