"""Tiny HF Qwen directories written by transformers itself (the real producer), random weights."""
from __future__ import annotations

from pathlib import Path

TINY = dict(vocab_size=1003, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def make_hf_dir(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised transformers Qwen2/Qwen3 model (every tensor perturbed,
    biases and norm weights included, so no parameter is trivially 0 or 1)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    kwargs = dict(TINY, tie_word_embeddings=(arch == "qwen3"))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return out
