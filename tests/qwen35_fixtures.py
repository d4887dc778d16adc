"""Tiny random Qwen3.5 HF directories written by transformers itself (the real producer).

`make_qwen35_dir` saves a `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`, with a tiny
vision tower) or a `Qwen3_5ForCausalLM` (`qwen3_5_text`) with sizes chosen to catch formula
errors, then adds what a released checkpoint carries and transformers does not write:

- `mtp.*` tensors (the multi-token-prediction head; names and shapes as in Qwen/Qwen3.5-*,
  see docs/qwen35.md "Tensors"), which transformers ignores on load
  (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`);
- the released processor files (`preprocessor_config.json`, `video_preprocessor_config.json`;
  the releases have no `processor_config.json`) and the official `chat_template.jinja`;
- optionally the released dtype layout (bf16 with `linear_attn.A_log` and
  `linear_attn.norm.weight` in fp32) and the released single-shard file name
  `model.safetensors-00001-of-00001.safetensors` with its index.

Sizes: vocab 389, hidden 44, intermediate 70, 4 query / 2 KV heads of 32 dims (rotary 8 dims,
partial_rotary_factor 0.25), GDN with 2 key heads of 14 dims and 4 value heads of 20 dims
(value heads outnumber key heads, d_k != d_v), 5 layers: linear, linear, linear, full, linear;
rope_theta 5000 and rms_norm_eps 1e-5 (neither a default, so a hard-coded value shows).
Every parameter that transformers initialises to a constant (RMSNorm weights, the gated norm,
A_log, dt_bias, vision biases and LayerNorms) is re-drawn, so a formula error cannot hide behind
zeros or ones. A is drawn in (0.05, 1): with stronger decays the GDN output's RMS gets close to
zero at some positions and the gated RMSNorm amplifies fp32 rounding past 1e-4 (measured).
transformers' own fp32 forward is within ~2e-5 of a float64 evaluation on these weights.
Builds in well under a second once torch is imported.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "jscenegen" / "model" / "tokenizer" / "templates"
OFFICIAL_TEMPLATE = TEMPLATE_DIR / "qwen3_5_official.jinja"

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention",
               "linear_attention"]
TEXT = dict(vocab_size=389, hidden_size=44, intermediate_size=70, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
            max_position_embeddings=512, rms_norm_eps=1e-5, attention_bias=False,
            attn_output_gate=True, layer_types=LAYER_TYPES, full_attention_interval=4,
            linear_conv_kernel_dim=4, linear_key_head_dim=14, linear_value_head_dim=20,
            linear_num_key_heads=2, linear_num_value_heads=4,
            mamba_ssm_dtype="float32", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
            # rope_theta deliberately not a default (transformers' default is 10000, Qwen2/3's
            # 1e6, the release's 1e7) and small enough that every rotary pair turns visibly.
            rope_parameters=dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=2, hidden_size=32, intermediate_size=44, num_heads=2, in_channels=3,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
              hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])

# The released processor files (Qwen/Qwen3.5-*: preprocessor_config.json and
# video_preprocessor_config.json; values as Qwen3-VL / Qwen3.5 publish them), with the tiny
# tower's patch geometry.
PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 4,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast"}
VIDEO_PREPROCESSOR = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 4,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                      "video_processor_type": "Qwen3VLVideoProcessor", "do_sample_frames": True,
                      "fps": 2, "min_frames": 4, "max_frames": 768, "return_metadata": False}

# Special tokens of the Qwen3.5 tokenizer that the config and template refer to (the released
# ids are 248044.. ; here they follow the tiny BPE vocabulary).
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS = (
    "You are the Designer. Place furniture in the room with one action per turn.",
    "<action>{\"op\": \"place\", \"asset\": \"sofa\", \"x\": 1.25, \"y\": 0.5, \"yaw_deg\": 90}</action>",
    "Observation: the bed overlaps the wardrobe by 0.30 m; the path to the door is blocked.",
    "The Planner lists the objects; the Critic checks reachability and overlap. Done.",
)


def mtp_shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the `mtp.*` tensors of a released Qwen3.5 checkpoint, from `text_config`.

    One full-attention decoder layer (gated q_proj, q/k norms) plus the fc that fuses the
    normed token embedding and the normed last hidden state ([hidden, 2 * hidden]), three
    RMSNorms; the embedding and the head are shared with the main model.
    """
    h, i, hd = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * nh * hd, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }


def build_tokenizer():
    """The project's protocol tokenizer (byte-level BPE, `tokenizer_build`) plus the Qwen3.5
    special and added tokens, with the official Qwen3.5 chat template."""
    from jscenegen.model.tokenizer.build import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS * 4, vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    tok.add_tokens(ADDED, special_tokens=False)
    tok.chat_template = OFFICIAL_TEMPLATE.read_text()
    return tok


def _redraw_constants(model, gen) -> None:
    """Re-draw every parameter that starts constant (norms, gated norm, A_log, dt_bias, conv,
    biases, LayerNorms) and perturb the rest, so no parameter is trivially 0 or 1."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):        # log A, A in (0.05, 1): decays that matter
                p.copy_(torch.log(0.05 + 0.95 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif "norm" in name and "visual" not in name:
                # Qwen3_5RMSNorm is (1 + w) with w initialised to 0; the gated norm is plain w
                # initialised to 1. Either way draw w around its neutral value.
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.3 * noise)
            elif "visual" in name and "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * noise)        # vision LayerNorm weights (init 1)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)              # vision biases (init 0); the text has none
            elif name.endswith("conv1d.weight"):
                p.copy_(0.4 * noise)
            else:
                p.copy_(0.08 * noise)


def _config(model_type: str, tok, tie: bool, text_sizes: dict | None = None):
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(TEXT, **(text_sizes or {}))
    text.update(tie_word_embeddings=tie, eos_token_id=ids["<|endoftext|>"],
                vocab_size=max(text["vocab_size"], len(tok)))
    assert text["vocab_size"] == TEXT["vocab_size"], f"tokenizer ({len(tok)}) outgrew the vocab"
    if model_type == "qwen3_5_text":
        return Qwen3_5TextConfig(**text)
    if model_type != "qwen3_5":
        raise ValueError(f"model_type must be 'qwen3_5' or 'qwen3_5_text', got {model_type!r}")
    return Qwen3_5Config(
        text_config=text, vision_config=dict(VISION, out_hidden_size=text["hidden_size"]),
        tie_word_embeddings=tie, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])


def _rewrite_weights(out: Path, extra: dict, dtype: str, release_layout: bool) -> None:
    """Rewrite the saved safetensors with the `mtp.*` tensors appended, the released dtypes
    and, optionally, the released file name plus index."""
    import torch
    from safetensors.torch import load_file, save_file

    src = out / "model.safetensors"
    tensors = load_file(str(src))
    tensors.update(extra)
    if dtype == "bfloat16":               # the Qwen3.5 release: bf16, A_log and gated norm fp32
        keep32 = ("linear_attn.A_log", "linear_attn.norm.weight")
        tensors = {k: v if k.endswith(keep32) else v.to(torch.bfloat16) for k, v in tensors.items()}
    elif dtype != "float32":
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    src.unlink()
    name = "model.safetensors-00001-of-00001.safetensors" if release_layout else "model.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    if release_layout:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": size}, "weight_map": {k: name for k in tensors}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_qwen35_dir(root: str | Path, model_type: str = "qwen3_5", *, seed: int = 0,
                    mtp: bool = True, tie: bool | None = None, dtype: str = "float32",
                    release_layout: bool = False, text_sizes: dict | None = None) -> Path:
    """Write a tiny random Qwen3.5 HF directory under `root` and return it.

    Args:
      model_type: "qwen3_5" (Qwen3_5ForConditionalGeneration: weights under
        `model.language_model.*`, `model.visual.*`, `lm_head.weight`) or "qwen3_5_text"
        (Qwen3_5ForCausalLM: `model.*`, `lm_head.weight`).
      seed: torch seed of the weights (the tokenizer is deterministic).
      mtp: append the `mtp.*` tensors a released checkpoint carries.
      tie: tie lm_head to the embedding; default untied for qwen3_5, tied for qwen3_5_text,
        so both paths are exercised. A tied checkpoint stores no `lm_head.weight`.
      dtype: "float32" (parity tests) or "bfloat16" (the released storage: bf16 with
        `linear_attn.A_log` and `linear_attn.norm.weight` kept fp32).
      release_layout: write `model.safetensors-00001-of-00001.safetensors` + index (as
        Qwen/Qwen3.5-0.8B and -2B ship) instead of `model.safetensors`.
      text_sizes: overrides of `TEXT` (e.g. {"hidden_size": 48}, so that VERL 0.6 - 0.8's
        first-divisible placement shards tensors on dim 1 at W = 6); the vision tower's
        `out_hidden_size` follows `hidden_size`.

    The directory holds config.json, generation_config.json, the safetensors, tokenizer files,
    chat_template.jinja (the official Qwen3.5 template) and, for qwen3_5, the processor files.
    Raises ValueError for an unknown model_type or dtype.
    """
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    out = Path(root) / f"{model_type}-seed{seed}"
    if out.exists():
        shutil.rmtree(out)
    tie = (model_type == "qwen3_5_text") if tie is None else tie
    tok = build_tokenizer()
    config = _config(model_type, tok, tie, text_sizes)
    torch.manual_seed(seed)
    cls = Qwen3_5ForConditionalGeneration if model_type == "qwen3_5" else Qwen3_5ForCausalLM
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    _redraw_constants(model, gen)
    model.save_pretrained(out, safe_serialization=True)
    text = config.text_config if model_type == "qwen3_5" else config
    extra = {}
    if mtp:
        extra = {k: 0.08 * torch.randn(s, generator=gen) for k, s in mtp_shapes(text.to_dict()).items()}
        for k in extra:
            if k.endswith("norm.weight") or "norm_" in k:
                extra[k] = 0.3 * torch.randn(extra[k].shape, generator=gen)
    _rewrite_weights(out, extra, dtype, release_layout)
    if dtype == "bfloat16":               # the release's config says so too
        cfg = json.loads((out / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        cfg.get("text_config", {})["dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(OFFICIAL_TEMPLATE.read_text())
    if model_type == "qwen3_5":
        for name, d in (("preprocessor_config.json", PREPROCESSOR),
                        ("video_preprocessor_config.json", VIDEO_PREPROCESSOR)):
            (out / name).write_text(json.dumps(d, indent=2) + "\n")
    return out


__all__ = ["LAYER_TYPES", "TEXT", "VISION", "build_tokenizer", "make_qwen35_dir", "mtp_shapes"]
