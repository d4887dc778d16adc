"""The `model:` section of a run config: which weights to train and how to compute with them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jscenegen.config import Section


class ModelConfig(Section):
    """Which weights to train and how to compute with them."""

    path: str | None = Field(None, description="HF model directory (config.json + safetensors); "
                             "null: the CPU default's tiny model, created on first use")
    reference_path: str | None = Field(None, description="frozen reference model for the KL "
                                       "term (default: the initial policy weights)")
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    attention: Literal["xla", "cudnn"] = "xla"
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
                    remat=self.remat, attn_impl=self.attention, causal_balance=self.causal_balance,
                    train_vision=self.train_vision, scan_layers=self.scan_layers)
