"""`QwenConfig`: the architecture of a Qwen2/2.5/3 or Qwen3.5 decoder, read from an HF `config.json`.

Every field that changes the math is read from the file (rope_theta, rope scaling, norms,
biases, tied head); nothing is assumed. Mirrors transformers' `Qwen2Config` / `Qwen3Config`
(transformers/models/qwen{2,3}/configuration_qwen{2,3}.py), including both spellings of RoPE
parameters: 4.x top-level `rope_theta` + `rope_scaling`, and 5.x `rope_parameters`.

Qwen3.5 (`qwen3_5`, the composite vision-language config with `text_config` and
`vision_config`, and `qwen3_5_text`) is the same dataclass with its hybrid fields set
(`layer_types`, partial RoPE, the Gated DeltaNet sizes, the vision tower's shapes): one config
type keeps the one weight table, the one loader, the converters and the mesh report
architecture-agnostic. transformers' `Qwen3_5Config` / `Qwen3_5TextConfig`
(models/qwen3_5/configuration_qwen3_5.py) give the defaults; docs/qwen35.md section 1 lists
every field and why it matters. The file read is kept (`hf_config`) and written back unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jscenegen.model.dtypes import SAFETENSORS
from jscenegen.paths import not_a_file, read_json_object

DENSE_MODEL_TYPES = ("qwen2", "qwen3")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


class ModelConfigError(ValueError):
    """An HF config that jscenegen cannot run; the message names the file and field."""


# Sanity bounds on the sizes a config.json may give, far above any real model (Qwen3-235B:
# 94 layers, hidden 4096, vocab 151936), so that a typo is refused at once instead of
# planning (or allocating) an absurd model.
SIZE_LIMITS = {"vocab_size": 10_000_000, "hidden_size": 1_000_000,
               "intermediate_size": 10_000_000, "num_hidden_layers": 10_000,
               "num_attention_heads": 100_000, "head_dim": 100_000}
OTHER_SIZE_LIMIT = 1_000_000  # the Gated DeltaNet sizes
# the vision tower's sizes (VisionShapes; its blocks are built one module each, so a mistyped
# depth of 10^4 took minutes before the loader could name the missing tensors)
VISION_SIZE_LIMITS = {"depth": 128, "in_channels": 16, "patch_size": 1024,
                      "temporal_patch_size": 64, "spatial_merge_size": 64}
# the Gated DeltaNet sizes a Qwen3.5 text config may leave out: transformers' defaults
# (Qwen3_5TextConfig)
QWEN35_LINEAR_DEFAULTS = (("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128),
                          ("linear_value_head_dim", 128), ("linear_num_key_heads", 16),
                          ("linear_num_value_heads", 32))


def _positive(value: Any, key: str, source: str, prefix: str = "", *,
              integer: bool = False, limit: float | None = None) -> Any:
    """`value` if it is a positive integer (`integer`) or finite positive number, not above
    `limit`; else ModelConfigError naming `source` and `prefix + key`."""
    kind = "integer" if integer else "number"
    if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or value <= 0):
        raise ModelConfigError(f"{source}: {prefix}{key} must be a positive {kind}, "
                               f"got {value!r}")
    if limit is not None and value > limit:
        raise ModelConfigError(f"{source}: {prefix}{key} {value} is above the sanity bound "
                               f"{limit:,}; no real model is that large")
    return value


def _flag(d: dict[str, Any], key: str, source: str, prefix: str = "") -> bool:
    """`d[key]` (default false) if it is a JSON boolean; else ModelConfigError naming it."""
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise ModelConfigError(f"{source}: {prefix}{key} must be true or false, got {value!r}")
    return value


def _is_token_id(value: Any, vocab: int) -> bool:
    """`value` is a token id of a `vocab`-token vocabulary: an integer (not a boolean) in
    0..vocab-1."""
    return type(value) is int and 0 <= value < vocab


def _token_ids(d: dict[str, Any], key: str, vocab: int, source: str, prefix: str = ""):
    """`d[key]`: None, a token id in 0..vocab-1 or a list of them (as a tuple); else
    ModelConfigError naming it."""
    value = d.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(_is_token_id(i, vocab) for i in ids):
        raise ModelConfigError(f"{source}: {prefix}{key} must be a token id in 0..{vocab - 1} or "
                               f"a list of them, got {value!r}")
    return tuple(value) if isinstance(value, list) else value


def _token_id(value: Any, key: str, vocab: int, source: str, prefix: str = "") -> int | None:
    """`value`: None or one token id in 0..vocab-1; else ModelConfigError naming `key`."""
    if value is not None and not _is_token_id(value, vocab):
        raise ModelConfigError(f"{source}: {prefix}{key} must be a token id in 0..{vocab - 1} or "
                               f"null, got {value!r}")
    return value


def _weights_dtype(*sections: tuple[dict[str, Any], str], source: str) -> str:
    """The first `dtype` / `torch_dtype` the (section, key prefix) pairs give (default
    float32). Each one given must be a dtype jscenegen stores (transformers reads either); else
    ModelConfigError naming the field."""
    given = [(prefix + key, section[key]) for section, prefix in sections
             for key in ("dtype", "torch_dtype") if section.get(key) is not None]
    for key, value in given:
        if value not in SAFETENSORS:
            raise ModelConfigError(f"{source}: {key} must be one of {', '.join(SAFETENSORS)}, "
                                   f"got {value!r}")
    return given[0][1] if given else "float32"


def config_with_dtype(doc: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json content `doc` saying its (text) weights are stored in `dtype`, as
    transformers' `save_pretrained` writes it: every `dtype` / `torch_dtype` key given, at the
    top level and in `text_config`, set to `dtype`; `dtype` added at the top when neither is.
    transformers loads weights in that dtype by default, whatever the files hold."""
    sections = [d for d in (doc, doc.get("text_config")) if isinstance(d, dict)]
    for section in sections:
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = dtype
    if not any(key in doc for key in ("dtype", "torch_dtype")):
        doc["dtype"] = dtype
    return doc


def config_with_mtp_layers(doc: dict[str, Any], model_type: str, mtp_layers: int) -> dict[str, Any]:
    """Qwen3.5 config.json content `doc` (of `model_type` qwen3_5 or qwen3_5_text) saying it
    carries `mtp_layers` MTP layers: `mtp_num_hidden_layers` (in `text_config` for the
    composite qwen3_5, at the top level for qwen3_5_text) set to it when it says another number
    (absent or null reads as 0, `QwenConfig.mtp_layers`). A directory transformers wrote holds
    no `mtp.*` (it drops the head), so its config must say 0: readers of a directory without
    weights (a checkpoint's `hf/`, a resumed run) take the count from here. The one rule for
    `QwenConfig.to_hf_dict` and the converters (`convert/tensor_sets.config_json`)."""
    text = doc.get("text_config") if model_type == "qwen3_5" else doc
    if isinstance(text, dict) and (text.get("mtp_num_hidden_layers") or 0) != mtp_layers:
        text["mtp_num_hidden_layers"] = mtp_layers
    return doc


def read_config_file(f: str | Path) -> dict:
    """The JSON object of config file `f`, for `QwenConfig.from_hf_dict`. Raises
    ModelConfigError naming `f` when it is not a regular file, not valid JSON, repeats a key
    within one object or is not an object (OSError, which names the file, when it cannot be
    read)."""
    return read_json_object(f, ModelConfigError)


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


@dataclasses.dataclass(frozen=True)
class VisionShapes:
    """The Qwen3.5 vision tower's sizes, read only to check and create its (carried) tensors.

    Fields and defaults are transformers' `Qwen3_5VisionConfig`; the tower is never run.
    """

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    out_hidden_size: int = 3584


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture hyper-parameters of a Qwen-family causal LM.

    Dense (qwen2, qwen3): `qkv_bias` is implied by model_type qwen2 (Qwen2/2.5 carry q/k/v
    biases); `qk_norm` by qwen3 (RMSNorm over head_dim on q and k before RoPE). `rope_scaling`
    is the normalised dict of transformers' `rope_parameters` minus `rope_theta` (keys:
    rope_type, factor, ...), or None.

    pad_token_id (every family; Qwen3.5: text_config's): transformers builds
    `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`, so that row of the input
    embedding gets no gradient from the lookup (`qwen.Embedding`; a tied head's gradient still
    reaches it). None: no such row. The GRPO trainer replaces it by the tokenizer's pad token,
    as VERL's actor does (`with_pad_token_id`).

    Hybrid (qwen3_5, qwen3_5_text; empty/zero defaults for dense models):
      layer_types: per layer "linear_attention" (Gated DeltaNet) or "full_attention" (gated
        attention); from `layer_types`, else the legacy `full_attention_interval`.
      partial_rotary_factor: RoPE rotates the first int(head_dim * factor) dims of each head.
      linear_*: the Gated DeltaNet sizes (conv kernel K, key/value head dims d_k/d_v, key and
        value head counts H_k/H_v).
      mrope_section / mrope_interleaved: multimodal RoPE layout; with text positions (the
        only ones jscenegen builds) it reduces exactly to plain partial RoPE.
      mtp_layers: multi-token-prediction layers whose `mtp.*` tensors the model carries
        (opaque, never run): `mtp_num_hidden_layers` of the file, or 0 when the directory's
        weights hold none (a directory transformers wrote).
      vision: the vision tower's shapes (qwen3_5 only; carried, never run).
      hf_config: the config.json read (JSON text), written back unchanged; not compared.
      stored_dtypes: ((name, dtype), ...) of tensors the source directory stores in a dtype
        other than `torch_dtype` (Qwen3.5 releases keep A_log and the gated norm fp32 in a
        bf16 file), so `save_hf` writes each tensor back as it was stored; not compared.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    mtp_layers: int = 0
    vision: VisionShapes | None = None
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)
    stored_dtypes: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False,
                                                                   repr=False)

    @property
    def hybrid(self) -> bool:
        """Qwen3.5: Gated DeltaNet + gated attention layers, zero-centred norms."""
        return self.model_type in HYBRID_MODEL_TYPES

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", *HYBRID_MODEL_TYPES)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's token mixer: `layer_types`, or full attention everywhere (dense)."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones): int(head_dim * factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def text_prefix(self) -> str:
        """Prefix of the decoder's tensor names: `model.language_model.` in the composite
        qwen3_5 layout (Qwen3_5ForConditionalGeneration), else `model.`."""
        return "model.language_model." if self.model_type == "qwen3_5" else "model."

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's causal conv: [q | k | v] = 2 H_k d_k + H_v d_v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rope_params(self) -> dict[str, Any]:
        """RoPE scaling parameters as a dict ({} for plain RoPE)."""
        return dict(self.rope_scaling or ())

    @property
    def rope_type(self) -> str:
        return self.rope_params.get("rope_type", "default")

    @property
    def context_positions(self) -> int:
        """The positions the model's RoPE is made for: max_position_embeddings, times the
        scaling `factor` of a linear, dynamic or YaRN RoPE (YaRN: of its
        original_max_position_embeddings when given), as vLLM derives a model's longest
        `max_model_len` (vllm/config: `_get_and_verify_max_len`)."""
        params = self.rope_params
        factor = params.get("factor")
        if self.rope_type not in ("linear", "dynamic", "yarn") or not factor:
            return self.max_position_embeddings
        base = (params.get("original_max_position_embeddings") or self.max_position_embeddings
                if self.rope_type == "yarn" else self.max_position_embeddings)
        return int(base * float(factor))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "QwenConfig":
        """Build from a parsed HF config dict.

        Raises ModelConfigError (naming `source` and the field) for an unsupported
        model_type, `auto_map` (remote code), an active sliding window, an unknown RoPE type
        or activation, or a missing required field; for Qwen3.5 also for the fields listed
        in `_read_qwen35`.
        """
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source}: expected a JSON object (an HF config.json), "
                                   f"got a JSON {_json_kind(d)}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            named = "has no model_type" if model_type is None else f"model_type {model_type!r} is not supported"
            raise ModelConfigError(
                f"{source}: {named}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2, Qwen2.5, Qwen3 dense, "
                "Qwen3.5 dense hybrid; not the qwen3_5_moe mixture of experts)"
            )
        if "auto_map" in d:
            raise ModelConfigError(
                f"{source}: needs trust_remote_code (auto_map {sorted(d['auto_map'])}); "
                "jscenegen refuses remote code. Supported: " + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if model_type in HYBRID_MODEL_TYPES:
            return _read_qwen35(d, source)
        if d.get("use_sliding_window", False) and d.get("sliding_window"):
            raise ModelConfigError(
                f"{source}: use_sliding_window=true (sliding_window={d['sliding_window']}) "
                "is not supported; only full attention"
            )
        if model_type == "qwen3" and d.get("attention_bias", False):
            raise ModelConfigError(f"{source}: attention_bias=true is not supported for qwen3 "
                                   "(no released Qwen3 has attention biases)")
        types = d.get("layer_types")
        if types is not None and (not isinstance(types, list)
                                  or any(t != "full_attention" for t in types)):
            other = types if not isinstance(types, list) else sorted(
                {str(t) for t in types if t != "full_attention"})
            raise ModelConfigError(f"{source}: layer_types holds {str(other)[:200]}; only "
                                   "'full_attention' layers are supported")
        act = _activation(d, source)
        _require_sizes(d, source)
        heads = d["num_attention_heads"]
        # transformers' Qwen2Config / Qwen3Config: absent is 32, null is num_attention_heads;
        # 0 is refused, not defaulted
        kv_heads = d.get("num_key_value_heads", DENSE_KV_HEADS_DEFAULT)
        kv_heads = heads if kv_heads is None else kv_heads
        _check_heads(heads, kv_heads, source, absent=None if "num_key_value_heads" in d
                     else "Qwen2Config / Qwen3Config")
        if model_type == "qwen3" and "head_dim" in d and d["head_dim"] is None:
            raise ModelConfigError(f"{source}: head_dim is null; transformers' Qwen3Config needs "
                                   "an integer (128 when the key is absent)")
        # transformers: Qwen3Config's head_dim defaults to 128; Qwen2 has no such field and
        # its attention takes hidden_size // heads
        given = d.get("head_dim", 128 if model_type == "qwen3" else None)
        head_dim = _positive(given if given is not None else d["hidden_size"] // heads, "head_dim", source,
                             integer=True, limit=SIZE_LIMITS["head_dim"])
        if head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim {head_dim} must be even (RoPE rotates "
                                   "pairs of each head's dims)")
        theta, scaling, _ = _read_rope(d, source)
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_positive(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", source)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=_flag(d, "tie_word_embeddings", source),
            hidden_act=act,
            max_position_embeddings=_positive(d.get("max_position_embeddings", 32768),
                                              "max_position_embeddings", source, integer=True),
            bos_token_id=_token_ids(d, "bos_token_id", d["vocab_size"], source),
            eos_token_id=_token_ids(d, "eos_token_id", d["vocab_size"], source),
            pad_token_id=_token_id(d.get("pad_token_id"), "pad_token_id", d["vocab_size"], source),
            torch_dtype=_weights_dtype((d, ""), source=source),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "QwenConfig":
        """Read `path/config.json`, and what the directory's weights say about storage.

        When the directory holds safetensors weights, their headers (not the data) give
        `stored_dtypes` and, for Qwen3.5, whether `mtp.*` tensors are present (`mtp_layers`
        is 0 when not: transformers drops them on save). A directory without weights (a
        checkpoint's `hf/`) keeps the config's values.
        Raises ModelConfigError if config.json is missing or unparsable, or when the weights
        hold `mtp.*` tensors of another number of MTP layers than config.json says.
        """
        from jscenegen.model.safetensors_stream import stored_tensors

        if Path(path).is_file():   # `--model DIR/config.json`: it said DIR/config.json/config.json
            raise ModelConfigError(f"{path}: a file; give the model directory that holds it "
                                   f"({Path(path).parent})")
        f = Path(path) / "config.json"
        if why := not_a_file(f):
            raise ModelConfigError(f"{f}: {why}; model directory {path} needs its config.json")
        cfg = cls.from_hf_dict(read_config_file(f), str(f))
        stored = stored_tensors(path)
        if stored is None:
            return cfg
        held = cfg.with_storage({name: dtype for name, (dtype, _) in stored.items()})
        if held.mtp_layers not in (0, cfg.mtp_layers):
            key = ("text_config." if cfg.model_type == "qwen3_5" else "") + "mtp_num_hidden_layers"
            raise ModelConfigError(
                f"{f}: {key} is {cfg.mtp_layers}, but the weights beside it hold "
                f"{held.mtp_layers} MTP layer(s) (mtp.layers.0-{held.mtp_layers - 1}): they "
                "describe different models")
        return held

    def with_pad_token_id(self, pad_token_id: int | None, source: str) -> "QwenConfig":
        """This config with `pad_token_id` (a tokenizer's pad token: VERL's actor sets the
        model config's pad_token_id from its tokenizer, `override_config_kwargs` in its FSDP
        workers, whatever config.json says). Raises ModelConfigError naming `source` for an id
        outside the vocabulary."""
        pad = _token_id(pad_token_id, "pad_token_id", self.vocab_size, source)
        return dataclasses.replace(self, pad_token_id=pad)

    def with_storage(self, dtypes: dict[str, str]) -> "QwenConfig":
        """This config with what a directory's weights hold: {tensor name: dtype name}.

        Sets `stored_dtypes` (the tensors stored in a dtype other than `torch_dtype`) and, for
        Qwen3.5, `mtp_layers` from the `mtp.layers.N.` names present (0 without `mtp.*`).
        """
        exceptions = tuple(sorted((n, dt) for n, dt in dtypes.items() if dt != self.torch_dtype))
        mtp = self.mtp_layers
        if self.hybrid:
            layers = {int(n.split(".")[2]) for n in dtypes if n.startswith("mtp.layers.")}
            mtp = max(layers) + 1 if layers else 0
        return dataclasses.replace(self, stored_dtypes=exceptions, mtp_layers=mtp)

    def stored_dtype(self, name: str) -> str:
        """The dtype the source directory stores tensor `name` in (default `torch_dtype`)."""
        return dict(self.stored_dtypes).get(name, self.torch_dtype)

    def assumed_tower_note(self) -> str:
        """For a composite `qwen3_5` config.json without a vision_config, the note that
        transformers' default tower (`VisionShapes`: 27 blocks) is assumed, as transformers does;
        else "". Errors about the tower's tensors and mesh-report's sizes add it."""
        if self.model_type != "qwen3_5" or json.loads(self.hf_config or "{}").get("vision_config"):
            return ""
        return (f"config.json has no vision_config: transformers' default tower, depth "
                f"{VisionShapes().depth}, is assumed")

    def assumed_sizes_note(self) -> str:
        """For a Qwen3.5 config.json whose text config leaves out a linear-attention size,
        "; <field> is absent, so transformers' default <value> was assumed" for each (what a
        shape error then owes the user); else ""."""
        if not self.hybrid:
            return ""
        doc = json.loads(self.hf_config or "{}")
        prefix = "text_config." if self.model_type == "qwen3_5" else ""
        text = doc.get("text_config", {}) if prefix else doc
        absent = [f"{prefix}{key} is absent, so transformers' default {value} was assumed"
                  for key, value in QWEN35_LINEAR_DEFAULTS if key not in text]
        return "".join(f"; {a}" for a in absent)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content.

        Qwen3.5: the dict that was read (`hf_config`), vision_config and all, unchanged but
        for `mtp_num_hidden_layers`, which becomes the MTP layers carried (`mtp_layers`; 0 for a
        directory without `mtp.*` tensors: `config_with_mtp_layers`).
        Dense: transformers 4.x spelling, readable by 4.x and 5.x.
        """
        if self.hybrid:
            return config_with_mtp_layers(json.loads(self.hf_config), self.model_type,
                                          self.mtp_layers)
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_params or None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type == "qwen3":
            d["attention_bias"] = False
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            d["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return d


def _activation(d: dict[str, Any], source: str) -> str:
    act = d.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (silu)")
    return act


def _require_sizes(d: dict[str, Any], source: str, prefix: str = "") -> None:
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        _positive(d.get(key), key, source, prefix, integer=True, limit=SIZE_LIMITS[key])


def _check_heads(heads: int, kv_heads: int, source: str, prefix: str = "",
                 names: tuple[str, str] = ("num_attention_heads", "num_key_value_heads"),
                 absent: str | None = None) -> None:
    """Raise ModelConfigError unless `kv_heads` is a positive integer that divides `heads`.
    `absent`: the transformers config class whose default `kv_heads` is, the file not giving
    `names[1]` (the error says so: the file holds no such value)."""
    _positive(kv_heads, names[1], source, prefix, integer=True)
    if heads % kv_heads:
        why = (f" (absent from the file: transformers' {absent} default, {kv_heads}; give "
               f"{prefix}{names[1]}, a divisor of {heads})" if absent else "")
        raise ModelConfigError(f"{source}: {prefix}{names[0]} {heads} is not a multiple of "
                               f"{prefix}{names[1]} {kv_heads}{why}")


def _read_qwen35(d: dict[str, Any], source: str) -> QwenConfig:
    """A Qwen3.5 config (composite `qwen3_5` or `qwen3_5_text`), defaults as transformers'
    `Qwen3_5TextConfig` / `Qwen3_5VisionConfig`.

    Raises ModelConfigError naming the field for: a composite config without `text_config` or
    whose `text_config.model_type` is not qwen3_5_text; top-level and text_config
    `tie_word_embeddings` that disagree (transformers' two classes would tie differently);
    `attn_output_gate: false` (transformers always builds the gate, so such a file's weights
    would be misread); `attention_bias: true`; a `layer_types` entry other than
    linear_attention/full_attention or of the wrong length; linear value heads not a multiple
    of the key heads; a rotary dim that is odd or exceeds head_dim.
    """
    model_type = d["model_type"]
    vision = None
    if model_type == "qwen3_5":
        t = d.get("text_config")
        if not isinstance(t, dict):
            raise ModelConfigError(f"{source}: model_type qwen3_5 needs a text_config object")
        if t.get("model_type", "qwen3_5_text") != "qwen3_5_text":
            raise ModelConfigError(f"{source}: text_config.model_type {t.get('model_type')!r} is "
                                   "not supported; expected qwen3_5_text")
        prefix = "text_config."
        tie = _flag(d, "tie_word_embeddings", source)
        if "tie_word_embeddings" in t and _flag(t, "tie_word_embeddings", source, prefix) != tie:
            raise ModelConfigError(
                f"{source}: tie_word_embeddings ({tie}) and text_config.tie_word_embeddings "
                f"({bool(t['tie_word_embeddings'])}) disagree; transformers ties the head by the "
                "top-level value in Qwen3_5ForConditionalGeneration and by text_config's in "
                "Qwen3_5ForCausalLM, so the weights would mean different models. Set both to "
                "the same value")
        v = d.get("vision_config")
        if v is None:
            v = {}
        if not isinstance(v, dict):
            raise ModelConfigError(f"{source}: vision_config must be an object (the vision "
                                   f"tower's sizes) or absent, got {type(v).__name__}")
        defaults = VisionShapes()
        vision = VisionShapes(**{
            f.name: _positive(v.get(f.name, getattr(defaults, f.name)), f.name, source,
                              "vision_config.", integer=True,
                              limit=VISION_SIZE_LIMITS.get(f.name, OTHER_SIZE_LIMIT))
            for f in dataclasses.fields(VisionShapes)})
    else:
        t, prefix = d, ""
        tie = _flag(d, "tie_word_embeddings", source)
    act = _activation(t, source)
    _require_sizes(t, source, prefix)
    if t.get("attn_output_gate", True) is not True:
        raise ModelConfigError(
            f"{source}: {prefix}attn_output_gate={t['attn_output_gate']!r} is not supported: "
            "transformers' Qwen3.5 attention always has the output gate (q_proj is 2 x wide) "
            "and ignores this field, so the weights would be misread; only true")
    if t.get("attention_bias", False):
        raise ModelConfigError(f"{source}: {prefix}attention_bias=true is not supported "
                               "(no released Qwen3.5 has attention biases)")
    layers = t["num_hidden_layers"]
    if t.get("layer_types") is not None:
        if not isinstance(t["layer_types"], list):
            raise ModelConfigError(f"{source}: {prefix}layer_types must be a list (one entry per "
                                   f"layer), got {type(t['layer_types']).__name__}")
        kinds = tuple(t["layer_types"])
        where = f"{prefix}layer_types"
    else:
        interval = t.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval <= 0:
            raise ModelConfigError(f"{source}: {prefix}full_attention_interval must be a "
                                   f"positive integer, got {interval!r}")
        kinds = tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                      for i in range(layers))
        where = f"{prefix}full_attention_interval"
    bad = sorted({json.dumps(k)[:40] for k in kinds if k not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if bad or len(kinds) != layers:
        raise ModelConfigError(
            f"{source}: {where} must give {layers} entries ({prefix}num_hidden_layers), each "
            f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}; got {len(kinds)} entries"
            + (f" with {', '.join(bad)}" if bad else ""))
    heads = t["num_attention_heads"]
    kv_heads = t.get("num_key_value_heads", 4)
    _check_heads(heads, kv_heads, source, prefix,
                 absent=None if "num_key_value_heads" in t else "Qwen3_5TextConfig")
    linear = {}
    for key, default in QWEN35_LINEAR_DEFAULTS:
        linear[key] = _positive(t.get(key, default), key, source, prefix, integer=True,
                                limit=OTHER_SIZE_LIMIT)
    _check_heads(linear["linear_num_value_heads"], linear["linear_num_key_heads"], source,
                 prefix, ("linear_num_value_heads", "linear_num_key_heads"))
    head_dim = _positive(t.get("head_dim", 256), "head_dim", source, prefix, integer=True,
                         limit=SIZE_LIMITS["head_dim"])
    theta, scaling, extra = _read_rope(t, source, prefix)
    factor = float(_positive(extra.get("partial_rotary_factor", QWEN35_ROTARY_FACTOR), "partial_rotary_factor",
                             source, prefix))
    rotary = int(head_dim * factor)
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ModelConfigError(f"{source}: {prefix}partial_rotary_factor {factor} with head_dim "
                               f"{head_dim} gives {rotary} rotary dims; need an even number in "
                               f"(0, head_dim]")
    mrope = extra.get("mrope_section")
    if mrope is not None and (not isinstance(mrope, list) or not all(
            type(n) is int and n >= 0 for n in mrope)):
        raise ModelConfigError(f"{source}: {prefix}rope_parameters.mrope_section must be a list "
                               f"of integers >= 0 (the rotary pairs of M-RoPE's time, height and "
                               f"width), got {str(mrope)[:80]}")
    return QwenConfig(
        model_type=model_type,
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_positive(t.get("rms_norm_eps", 1e-6), "rms_norm_eps", source, prefix)),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        tie_word_embeddings=tie,
        hidden_act=act,
        max_position_embeddings=_positive(t.get("max_position_embeddings", 32768),
                                          "max_position_embeddings", source, prefix, integer=True),
        bos_token_id=_token_ids(t, "bos_token_id", t["vocab_size"], source, prefix),
        eos_token_id=_token_ids(t, "eos_token_id", t["vocab_size"], source, prefix),
        pad_token_id=_token_id(t.get("pad_token_id"), "pad_token_id", t["vocab_size"], source,
                               prefix),
        torch_dtype=_weights_dtype((d, ""), (t, prefix), source=source),
        layer_types=kinds,
        partial_rotary_factor=factor,
        mrope_section=tuple(mrope) if mrope is not None else None,
        mrope_interleaved=_flag(extra, "mrope_interleaved", source, f"{prefix}rope_parameters."),
        mtp_layers=_mtp_layers(t, source, prefix),
        vision=vision,
        hf_config=json.dumps(d),
        **linear,
    )


def _mtp_layers(t: dict[str, Any], source: str, prefix: str) -> int:
    """`mtp_num_hidden_layers`: an integer >= 0 (absent or null: 0); a boolean is refused."""
    value = t.get("mtp_num_hidden_layers")
    if value is None or (value == 0 and type(value) is int):
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"{source}: {prefix}mtp_num_hidden_layers must be an integer >= 0, "
                               f"got {value!r}")
    return _positive(value, "mtp_num_hidden_layers", source, prefix, integer=True,
                     limit=SIZE_LIMITS["num_hidden_layers"])


# transformers' Qwen2Config and Qwen3Config (5.25): `num_key_value_heads: int | None = 32`, the
# heads of a config.json without the key (only an explicit null means num_attention_heads);
# Qwen3_5TextConfig's default is 4 (`_read_qwen35`)
DENSE_KV_HEADS_DEFAULT = 32
ROPE_EXTRAS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# transformers' RotaryEmbeddingConfigMixin.default_theta, the theta of a config.json that gives
# none anywhere; Qwen2Config, Qwen3Config and Qwen3_5TextConfig do not override it
ROPE_DEFAULT_THETA = 10_000.0


def _rope_section(d: dict[str, Any], key: str, source: str, prefix: str) -> dict[str, Any]:
    """A copy of `d[key]` (`rope_scaling` or `rope_parameters`); {} when absent, null or empty.
    Raises ModelConfigError naming the field when it is not an object or is nested by layer
    type."""
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ModelConfigError(f"{source}: {prefix}{key} must be an object (rope_type, "
                               f"factor, ...) or null, got {str(value)[:80]!r}")
    if any(isinstance(v, dict) for v in value.values()):
        raise ModelConfigError(f"{source}: per-layer-type {prefix}{key} are not supported")
    return dict(value)


def _read_rope(d: dict[str, Any], source: str,
               prefix: str = "") -> tuple[float, dict[str, Any], dict[str, Any]]:
    """(rope_theta, scaling params, extras) from either config spelling; validates the RoPE type.

    As transformers' `RotaryEmbeddingConfigMixin.convert_rope_params_to_dict` (5.25): the RoPE
    dict is `rope_scaling or rope_parameters`; its `rope_theta` wins, else the top-level one,
    else `ROPE_DEFAULT_THETA` (10000, for Qwen2/3 as for Qwen3.5). extras: `ROPE_EXTRAS` found
    in that dict (which wins) or at the top level. A file giving both dicts is read only when
    the two mean the same RoPE: transformers takes `rope_scaling` and drops `rope_parameters`
    whole (its theta included), which a file that says two things cannot have meant for sure.

    Raises ModelConfigError naming the field for a RoPE dict that is not an object or nested by
    layer type, `rope_scaling` and `rope_parameters` that disagree, an unsupported rope type, a
    scaled RoPE without a `factor`, or a non-positive theta, factor, beta or length.
    """
    scaling = _rope_section(d, "rope_scaling", source, prefix)
    params = _rope_section(d, "rope_parameters", source, prefix)
    if scaling and params:
        kept = _rope_reading(d, scaling, "rope_scaling", source, prefix)
        dropped = _rope_reading(d, params, "rope_parameters", source, prefix)
        if kept != dropped:
            def show(reading):
                theta, p, extras = reading
                return f"theta {theta:g}" + "".join(f", {k} {v!r}" for k, v in
                                                    sorted({**p, **extras}.items()))
            raise ModelConfigError(
                f"{source}: {prefix}rope_scaling and {prefix}rope_parameters are both given "
                f"and disagree: rope_scaling means {show(kept)}; rope_parameters means "
                f"{show(dropped)}. transformers reads rope_scaling and drops rope_parameters "
                "(its rope_theta too); remove the one that is wrong")
        return kept
    if scaling:
        return _rope_reading(d, scaling, "rope_scaling", source, prefix)
    return _rope_reading(d, params, "rope_parameters" if params else "rope_scaling", source,
                         prefix)


def _rope_reading(d: dict[str, Any], params: dict[str, Any], section: str, source: str,
                  prefix: str) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """`_read_rope`'s reading of one RoPE dict `params` (a copy; `section` names it)."""
    theta = params.pop("rope_theta", d.get("rope_theta", ROPE_DEFAULT_THETA))
    extras = {k: params.pop(k) if k in params else d[k] for k in ROPE_EXTRAS
              if k in params or k in d}
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: {prefix}rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type != "default" and "factor" not in params:
        raise ModelConfigError(f"{source}: {prefix}rope scaling {rope_type!r} needs a 'factor'")
    if rope_type != "default":  # a factor of 0 divides the frequencies by zero: NaN logits
        for key in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            if params.get(key) is not None:
                _positive(params[key], f"{section}.{key}", source, prefix)
        if params.get("original_max_position_embeddings") is not None:
            _positive(params["original_max_position_embeddings"],
                      f"{section}.original_max_position_embeddings", source, prefix, integer=True)
    if rope_type == "yarn":
        params.setdefault(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings", d.get("max_position_embeddings", 32768)),
        )
    if rope_type == "default":
        params = {}
    return float(_positive(theta, "rope_theta", source, prefix)), params, extras


PRESETS: dict[str, dict[str, int]] = {
    # micro: the CPU default's policy (2 cores learn the protocol's format in ~300 SFT steps)
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, intermediate_size=384),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=768),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1536),
}


# transformers' Qwen3_5TextConfig default, and every release's: a quarter of each head rotates
QWEN35_ROTARY_FACTOR = 0.25

# Qwen3.5 presets (init-model --arch qwen3_5): 3 Gated DeltaNet layers then 1 gated attention
# layer, repeated, as the releases; GDN value heads outnumber key heads as in 4B..27B.
HYBRID_PRESETS: dict[str, dict[str, int]] = {
    "micro": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, intermediate_size=384,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=768,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                  linear_value_head_dim=64),
}
# The presets' vision tower: the released geometry (patch 16, temporal patch 2, merge 2, so the
# released processor files apply) at a tiny width; carried, never run by jscenegen.
PRESET_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                     num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
                     deepstack_visual_indexes=[], initializer_range=0.02, model_type="qwen3_5")
# Keys of a composite qwen3_5 config.json that live at the top level, not in text_config.
COMPOSITE_TOP_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id",
                      "vision_end_token_id", "tie_word_embeddings")


def qwen35_preset_dict(preset: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The composite `qwen3_5` config.json of an init-model preset, laid out as the releases'.

    `overrides` go into text_config, except `COMPOSITE_TOP_KEYS` (top level; a tied head is
    written at both levels, as the releases do). Raises ModelConfigError for an unknown preset.
    """
    if preset not in HYBRID_PRESETS:
        raise ModelConfigError(f"unknown preset {preset!r}; choose from {', '.join(HYBRID_PRESETS)}")
    top = {k: overrides.pop(k) for k in COMPOSITE_TOP_KEYS if k in overrides}
    tie = bool(top.pop("tie_word_embeddings", True))
    p = HYBRID_PRESETS[preset]
    layers = overrides.get("num_hidden_layers", p["num_hidden_layers"])
    text = dict(
        model_type="qwen3_5_text", vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=32768, attention_bias=False, attention_dropout=0.0,
        attn_output_gate=True, linear_conv_kernel_dim=4, full_attention_interval=4,
        layer_types=[LINEAR_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(layers)],
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, mamba_ssm_dtype="float32",
        initializer_range=0.02, use_cache=True, dtype="float32", tie_word_embeddings=tie,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0,
                             partial_rotary_factor=QWEN35_ROTARY_FACTOR, mrope_interleaved=True),
        **p)
    text.update(overrides)
    # M-RoPE's time/height/width rotary pairs in the releases' 11:11:10 split, summing to
    # rotary/2 as there (the releases' head_dim 256 gives [11, 11, 10])
    rope = text["rope_parameters"] = dict(text["rope_parameters"])
    pairs = int(text["head_dim"] * rope.get("partial_rotary_factor", QWEN35_ROTARY_FACTOR)) // 2
    third = round(pairs * 11 / 32)
    rope.setdefault("mrope_section", [third, third, pairs - 2 * third])
    vision = dict(PRESET_VISION, out_hidden_size=text["hidden_size"])
    return dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
                text_config=text, vision_config=vision, tie_word_embeddings=tie, **top)


def preset_config(arch: str, preset: str, vocab_size: int, **overrides: Any) -> QwenConfig:
    """A QwenConfig for `jscenegen init-model` presets (`PRESETS`: micro, tiny, small; for
    arch qwen3_5 `HYBRID_PRESETS` through `qwen35_preset_dict`).

    Raises ModelConfigError for an unknown preset or an invalid config."""
    if arch == "qwen3_5":
        return QwenConfig.from_hf_dict(qwen35_preset_dict(preset, vocab_size, **overrides),
                                       f"preset {arch}/{preset}")
    if preset not in PRESETS:
        raise ModelConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    d = dict(model_type=arch, vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
             tie_word_embeddings=(arch == "qwen3"), max_position_embeddings=32768,
             **PRESETS[preset])
    d.update(overrides)
    return QwenConfig.from_hf_dict(d, f"preset {arch}/{preset}")
