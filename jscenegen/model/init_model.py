"""Create a fresh HF model directory: tokenizer, chat template, config and random weights.

Used for tests and the CPU default (`jscenegen init-model`). The weights are transformers'
default initialisation (normal(0, 0.02) matrices, ones for norms, zero biases; Qwen3.5: zero
(1 + w) norms, dt_bias 1, A_log = log(U(0.01, 16))), seeded.

`arch="qwen3_5"` writes a directory laid out as a Qwen3.5 release that transformers loads as
`Qwen3_5ForConditionalGeneration` (or `AutoModelForCausalLM`): the composite config with a tiny
vision tower, the vision and MTP tensors, the released processor files, the protocol
tokenizer with the Qwen3.5 special tokens, and the prefix-preserving protocol chat template.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

from flax import nnx

from jscenegen.model.config import preset_config
from jscenegen.model.hf_io import save_hf
from jscenegen.model.loader import model_class
from jscenegen.model.tokenizer.build import train_bpe_tokenizer, train_qwen35_tokenizer
from jscenegen.model.weights import redraw_constant_tensors
from jscenegen.paths import write_json

# The processor files of the Qwen3.5 releases (Qwen/Qwen3.5-*: Qwen3-VL's processors; values
# as published, docs/qwen35.md section 3.5). jscenegen carries them and never runs them.
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast"}
VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True, "fps": 2,
    "min_frames": 4, "max_frames": 768, "return_metadata": False}


def init_model_dir(out: str | Path, *, arch: str = "qwen3", preset: str = "tiny", seed: int = 0,
                   texts: Iterable[str], vocab_size: int = 8192, randomise_constant: bool = False,
                   **overrides) -> Path:
    """Train a tokenizer on `texts`, build a random `arch`/`preset` model and save both to `out`
    (`randomise_constant`: every tensor that starts as one value gets N(0, 0.05^2) noise,
    `weights.redraw_constant_tensors`, for parity checks).

    The model's vocab_size is the tokenizer's length. eos: `<|im_end|>` (Qwen2/3); Qwen3.5
    as its releases, `<|endoftext|>` in config.json and both in generation_config.json.
    Returns `out`. Raises ModelConfigError for an unknown arch or preset.
    """
    if arch == "qwen3_5":
        tokenizer = train_qwen35_tokenizer(texts, vocab_size=vocab_size)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
               ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                "<|vision_start|>", "<|vision_end|>")}
        overrides = dict(dict(eos_token_id=ids["<|endoftext|>"], image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"]), **overrides)
        generation = {"do_sample": True, "temperature": 1.0, "top_p": 1.0,
                      "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    else:
        tokenizer = train_bpe_tokenizer(texts, vocab_size=vocab_size)
        overrides = dict(dict(eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>")), **overrides)
        generation = None
    cfg = preset_config(arch, preset, vocab_size=len(tokenizer), **overrides)
    model = model_class(cfg)(cfg, rngs=nnx.Rngs(seed))
    if randomise_constant:
        redraw_constant_tensors(model, seed)
    with tempfile.TemporaryDirectory() as assets:
        tokenizer.save_pretrained(assets)
        if generation is not None:
            write_json(Path(assets) / "generation_config.json", generation)
            for name, content in (("preprocessor_config.json", PREPROCESSOR_CONFIG),
                                  ("video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)):
                write_json(Path(assets) / name, content)
        return save_hf(model, out, tokenizer_src=assets)
