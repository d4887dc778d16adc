"""The tiny Qwen3.5 directories of tests/qwen35_fixtures.py are what a release looks like and
what transformers itself loads (so the Qwen3.5 model, HF I/O and conversion tests can trust them)."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def dirs(qwen35_hf):
    return qwen35_hf   # conftest: the same three directories, built once per session


def _header(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def test_tensors_are_the_released_set(dirs):
    from qwen35_fixtures import TEXT, VISION, mtp_shapes

    vlm = _header(dirs["qwen3_5"] / "model.safetensors")
    text = _header(dirs["qwen3_5_text"] / "model.safetensors")
    assert {k: s for k, (_, s) in vlm.items() if k.startswith("mtp.")} == mtp_shapes(TEXT)
    assert sum(k.startswith("model.visual.") for k in vlm) == 12 * VISION["depth"] + 9
    assert "lm_head.weight" in vlm and "lm_head.weight" not in text          # untied / tied
    assert all(k.startswith(("model.language_model.", "model.visual.", "mtp.", "lm_head.")) for k in vlm)
    assert all(k.startswith(("model.", "mtp.")) and not k.startswith("model.visual.") for k in text)
    conv = vlm["model.language_model.layers.0.linear_attn.conv1d.weight"][1]
    assert conv == (2 * 2 * 14 + 4 * 20, 1, 4)                            # [C, 1, K], C = 2*Hk*Dk + Hv*Dv


def test_release_layout_and_dtypes(dirs):
    d = dirs["release"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors-00001-of-00001.safetensors"}
    header = _header(d / "model.safetensors-00001-of-00001.safetensors")
    f32 = {k for k, (dt, _) in header.items() if dt == "F32"}
    assert f32 == {k for k in header if k.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
    assert {dt for k, (dt, _) in header.items() if k not in f32} == {"BF16"}
    assert {p.name for p in d.iterdir()} >= {"preprocessor_config.json", "video_preprocessor_config.json",
                                            "chat_template.jinja", "tokenizer.json", "config.json"}


def test_no_parameter_is_left_at_its_constant_initial_value(dirs):
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(dirs["qwen3_5"]))
    for name, p in model.named_parameters():
        assert p.detach().float().std() > 1e-3, name


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_text", "qwen3_5 as CausalLM"])
def test_transformers_loads_it_and_left_padding_is_neutral(dirs, kind):
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    path = str(dirs[kind.split()[0]])
    cls = Qwen3_5ForConditionalGeneration if kind == "qwen3_5" else AutoModelForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info   # mtp.* ignored by design
    model.eval()
    ids = torch.randint(5, 300, (1, 11), generator=torch.Generator().manual_seed(0))
    pad = 4
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], 1),
                       torch.cat([ids, torch.zeros(1, pad, dtype=torch.long)], 1)])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    mask[1, -pad:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0]
        out = model(input_ids=batch, attention_mask=mask, position_ids=positions).logits
    assert (out[0, pad:] - ref).abs().max() < 1e-4
    assert (out[1, :-pad] - ref).abs().max() < 1e-4
