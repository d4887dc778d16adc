"""`QwenConfig`: the architecture of a Qwen2/2.5/3 decoder, read from an HF `config.json`.

Every field that changes the math is read from the file (rope_theta, rope scaling, norms,
biases, tied head); nothing is assumed. Mirrors transformers' `Qwen2Config` / `Qwen3Config`
(transformers/models/qwen{2,3}/configuration_qwen{2,3}.py), including both spellings of RoPE
parameters: 4.x top-level `rope_theta` + `rope_scaling`, and 5.x `rope_parameters`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


class ModelConfigError(ValueError):
    """An HF config that jscenegen cannot run; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture hyper-parameters of a Qwen-family causal LM.

    `qkv_bias` is implied by model_type qwen2 (Qwen2/2.5 carry q/k/v biases); `qk_norm` by qwen3
    (RMSNorm over head_dim on q and k before RoPE). `rope_scaling` is the normalised dict of
    transformers' `rope_parameters` minus `rope_theta` (keys: rope_type, factor, ...), or None.
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
    rope_theta: float = 1_000_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    torch_dtype: str = "float32"

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def rope_params(self) -> dict[str, Any]:
        """RoPE scaling parameters as a dict ({} for plain RoPE)."""
        return dict(self.rope_scaling or ())

    @property
    def rope_type(self) -> str:
        return self.rope_params.get("rope_type", "default")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "QwenConfig":
        """Build from a parsed HF config dict.

        Raises ModelConfigError (naming `source` and the field) for an unsupported
        model_type, `auto_map` (remote code), an active sliding window, an unknown RoPE type
        or activation, or a missing required field.
        """
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2, Qwen2.5, Qwen3 dense)"
            )
        if "auto_map" in d:
            raise ModelConfigError(
                f"{source}: needs trust_remote_code (auto_map {sorted(d['auto_map'])}); "
                "jscenegen refuses remote code. Supported: " + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if d.get("use_sliding_window", False) and d.get("sliding_window"):
            raise ModelConfigError(
                f"{source}: use_sliding_window=true (sliding_window={d['sliding_window']}) "
                "is not supported; only full attention"
            )
        act = d.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (silu)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ModelConfigError(f"{source}: {key} must be a positive integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelConfigError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        theta, scaling = _read_rope(d, source)
        eos = d.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=act,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "QwenConfig":
        """Read `path/config.json`. Raises ModelConfigError if missing or unparsable."""
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ModelConfigError(f"{f}: no config.json in model directory {path}")
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{f}: not valid JSON: {err}") from None
        return cls.from_hf_dict(d, str(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content (transformers 4.x spelling, readable by 4.x and 5.x)."""
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
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            d["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return d


def _read_rope(d: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling params) from either config spelling; validates the RoPE type."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        if any(isinstance(v, dict) for v in params.values()):
            raise ModelConfigError(f"{source}: per-layer-type rope_parameters are not supported")
        params = dict(params)
        theta = params.pop("rope_theta", d.get("rope_theta", 1_000_000.0))
    else:
        theta = d.get("rope_theta", 1_000_000.0)
        params = dict(d.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type != "default" and "factor" not in params:
        raise ModelConfigError(f"{source}: rope scaling {rope_type!r} needs a 'factor'")
    if rope_type == "yarn":
        params.setdefault(
            "original_max_position_embeddings",
            d.get("original_max_position_embeddings", d.get("max_position_embeddings", 32768)),
        )
    if rope_type == "default":
        params = {}
    return float(theta), params


PRESETS: dict[str, dict[str, int]] = {
    # micro: the CPU default's policy (2 cores learn the protocol's format in ~300 SFT steps)
    "micro": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, intermediate_size=384),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=768),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1536),
}


def preset_config(arch: str, preset: str, vocab_size: int, **overrides: Any) -> QwenConfig:
    """A QwenConfig for `jscenegen init-model` presets (`PRESETS`: micro, tiny, small).

    Raises ModelConfigError for an unknown preset or an invalid config."""
    if preset not in PRESETS:
        raise ModelConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    d = dict(model_type=arch, vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
             tie_word_embeddings=(arch == "qwen3"), max_position_embeddings=32768,
             **PRESETS[preset])
    d.update(overrides)
    return QwenConfig.from_hf_dict(d, f"preset {arch}/{preset}")
