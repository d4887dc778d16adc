"""The `model:` section of a run config: which weights to train and how to compute with them."""
from __future__ import annotations

import functools
import logging
from typing import Any, Literal

from pydantic import Field

from jscenegen.config import Section


class ModelConfig(Section):
    """Which weights to train and how to compute with them."""

    path: str | None = Field(None, description="HF model directory (config.json + safetensors); "
                             "null: a fresh model of warm_start.arch and .preset (the CPU "
                             "default's: micro qwen3) after its SFT warm start "
                             "(warm_start.sft_config), made on first use and cached")
    reference_path: str | None = Field(None, description="frozen reference model for the KL "
                                       "term (default: the initial policy weights)")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype the trained parameters are held in (the micro-batch "
        "gradient sum, the AdamW moments and the update are float32 either way; bf16 keeps no "
        "fp32 master copy, so steps below "
        "half a bf16 spacing round away); weights are cast to it on loading whatever the file stores (carried "
        "tensors keep their stored dtype); the reference model is loaded in it too")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the activations and matmul operands (weights are "
        "cast to it; products accumulate in float32, logits are float32); also the sampler's "
        "KV-cache dtype, and its weights' unless rollout.dtype is set")
    remat: bool = Field(False, description="rematerialise each decoder layer (jax.checkpoint): "
                        "the backward pass recomputes the layer's forward instead of keeping its "
                        "activations (less memory, more compute)")
    remat_policy: Literal["full", "minimal"] = Field(
        "full", description="what a rematerialised layer keeps (with remat: true; MaxText's "
        "names): full keeps nothing and recomputes the whole layer; minimal keeps the "
        "projections' outputs (matmuls without batch dimensions) and recomputes the rest, so "
        "no projection runs twice")
    attention: Literal["xla", "cudnn"] = Field("xla", description="attention kernel: xla (any "
                                               "backend) or cudnn (GPU with compute_dtype "
                                               "bfloat16; xla elsewhere and with float32, with "
                                               "a warning)")
    causal_balance: bool = Field(False, description="reorder training sequences so each sp "
                                 "shard gets equal causal attention work (lengths must be a "
                                 "multiple of 2 x sp)")
    train_vision: bool = Field(False, description="Qwen3.5 (model_type qwen3_5): train the "
                               "vision tower's tensors (zero gradient on text, but AdamW "
                               "state and weight decay, as VERL with freeze_vision_tower "
                               "false); false: carried frozen, no Adam state")
    scan_layers: bool | None = Field(None, description="training forward as a lax.scan over "
                                     "the layers (bounds FSDP's gathered weights to one layer) "
                                     "or a Python loop; null: scan on a mesh of several "
                                     "devices, loop on one")

    def build_options(self) -> dict[str, Any]:
        """Keyword arguments of `loader.build_model` / `hf_io.load_hf` for this section."""
        return dict(param_dtype=self.param_dtype, compute_dtype=self.compute_dtype,
                    remat=self.remat and self.remat_policy,
                    attn_impl=attention_for_backend(self.attention, self.compute_dtype),
                    causal_balance=self.causal_balance,
                    train_vision=self.train_vision, scan_layers=self.scan_layers)


@functools.cache   # one warning per process, however many models a command builds
def attention_for_backend(attention: str, compute_dtype: str) -> str:
    """The kernel `attention` names on this process's JAX backend with activations in
    `compute_dtype`. cuDNN's fused attention exists on GPU only
    (`jax.nn.dot_product_attention(implementation="cudnn")` raises "cuDNN is not detected"
    elsewhere) and takes fp16/bf16 inputs only (jax raises "Unsupported dtype for inputs" at
    the first traced step, after the model is loaded), so `cudnn` runs as `xla` on CPU and TPU
    and with `model.compute_dtype: float32`, with a warning naming why, and one config serves
    every backend (configs/grpo100.yaml)."""
    if attention != "cudnn":
        return attention
    import jax

    backend = jax.default_backend()
    if backend != "gpu":
        why = f"needs a GPU; the {backend} backend runs xla attention"
    elif compute_dtype not in ("bfloat16", "float16"):
        why = (f"takes bfloat16 or float16 inputs only; with model.compute_dtype={compute_dtype} "
               "the GPU runs xla attention")
    else:
        return attention
    logging.getLogger(__name__).warning("model.attention=cudnn %s", why)
    return "xla"
