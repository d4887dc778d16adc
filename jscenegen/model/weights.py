"""The one table from HF parameter names to shapes, used by loading, saving, sharding and conversion.

Names and orientations are exactly transformers' Qwen2/Qwen3 state-dict keys
(`model.layers.N.self_attn.q_proj.weight` is [num_heads * head_dim, hidden], out x in, as
torch.nn.Linear stores it). jscenegen keeps weights in this orientation, so every format
(HF safetensors, VERL FSDP2 shards, orbax) maps name to name with no transposes.
"""
from __future__ import annotations

from jscenegen.model.config import QwenConfig


def param_shapes(cfg: QwenConfig, *, include_tied_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Ordered {hf_name: logical shape} of every trainable parameter.

    The order is `torch.nn.Module.parameters()` order of transformers' Qwen{2,3}ForCausalLM,
    which VERL's optimizer state indices follow. With tied embeddings there is no separate
    `lm_head.weight` parameter (set `include_tied_head` to list it as the alias torch's
    state_dict() still reports).
    """
    h, nq, nkv, hd, f, v = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (nq * hd, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nq * hd,)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq * hd)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings or include_tied_head:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def padded_shape(shape: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """`shape` with dim 0 rounded up to a multiple of `multiple` (FSDP2's padding, c = ceil(n/W))."""
    n = shape[0]
    return (-(-n // multiple) * multiple, *shape[1:])
