"""Create a fresh HF model directory: tokenizer, chat template, config and random weights.

Used for tests and the CPU default (`jscenegen init-model`). The weights are transformers'
default initialisation (normal(0, 0.02) matrices, ones for norms, zero biases), seeded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from flax import nnx

from jscenegen.model.config import preset_config
from jscenegen.model.hf_io import save_hf
from jscenegen.model.qwen import QwenForCausalLM
from jscenegen.model.tokenizer.build import train_bpe_tokenizer


def init_model_dir(out: str | Path, *, arch: str = "qwen3", preset: str = "tiny", seed: int = 0,
                   texts: Iterable[str], vocab_size: int = 8192, **overrides) -> Path:
    """Train a tokenizer on `texts`, build a random `arch`/`preset` model and save both to `out`.

    The model's vocab_size is the tokenizer's length; eos is `<|im_end|>`. Returns `out`.
    Raises ModelConfigError for an unknown arch or preset.
    """
    import tempfile

    tokenizer = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = preset_config(arch, preset, vocab_size=len(tokenizer), eos_token_id=eos, **overrides)
    model = QwenForCausalLM(cfg, rngs=nnx.Rngs(seed))
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save_pretrained(tok_dir)
        return save_hf(model, out, tokenizer_src=tok_dir)
