"""The commands on Qwen3.5: `jscenegen parity logits` (fp32 and bf16 against transformers'
torch classes, on directories transformers itself wrote), `jscenegen init-model --arch qwen3_5`,
`jscenegen mesh-report` on the composite released shapes, and the chat template fallback."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jscenegen.cli import main

torch = pytest.importorskip("torch")
SHAPES = Path(__file__).resolve().parents[1] / "configs" / "model-shapes"
TEXTS = ["<action>{\"op\": \"place\", \"asset\": \"sofa\"}</action> The Designer places a sofa."] * 20


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from jscenegen.model.init_model import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("init") / "micro", arch="qwen3_5",
                          preset="micro", texts=TEXTS, vocab_size=400, seed=3)


def test_init_model_writes_a_release_shaped_directory_transformers_loads(micro):
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    names = {p.name for p in micro.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                     "video_preprocessor_config.json"}
    cfg = json.loads((micro / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["text_config"]["model_type"] == "qwen3_5_text"
    assert cfg["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["vision_config"]["patch_size"] == 16
    assert json.loads((micro / "preprocessor_config.json").read_text())["patch_size"] == 16
    for cls in (Qwen3_5ForConditionalGeneration, AutoModelForCausalLM):
        model, info = cls.from_pretrained(micro, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (cls, info)
    params = dict(model.named_parameters())
    a = params["model.layers.0.linear_attn.A_log"].exp()
    assert ((a > 0.01) & (a < 16)).all() and a.std() > 0               # log U(0.01, 16)
    assert (params["model.layers.0.linear_attn.dt_bias"] == 1).all()
    assert (params["model.norm.weight"] == 0).all()                     # (1 + w) norms start at 0
    assert (params["model.layers.0.linear_attn.norm.weight"] == 1).all()
    gen = json.loads((micro / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro)
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"),
                                   tok.convert_tokens_to_ids("<|endoftext|>")]
    assert cfg["text_config"]["eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_init_model_tokenizer_and_template_work_for_the_protocol(micro):
    from jscenegen.model.tokenizer.chat import QWEN35_PROTOCOL_TEMPLATE, ChatTokenizer

    assert (micro / "chat_template.jinja").read_text() == QWEN35_PROTOCOL_TEMPLATE.read_text()
    chat = ChatTokenizer.from_dir(micro)
    assert chat.template_source == "tokenizer" and chat.eot_token == "<|im_end|>"
    conv, ids = chat.start("You are the Designer.", "Place a sofa.")
    ids += chat.encode(TEXTS[0]) + [chat.eot_id]
    conv.add_assistant(TEXTS[0], ended_with_eot=True)
    ids += conv.user_segment("Observation: ok.")
    assert chat.decode(ids) == conv.text
    assert conv.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_official_template_falls_back_to_the_protocol_variant(qwen35_hf, tmp_path, caplog):
    import shutil

    from jscenegen.model.tokenizer.chat import QWEN35_PROTOCOL_TEMPLATE, ChatTemplateError, ChatTokenizer

    chat = ChatTokenizer.from_dir(qwen35_hf["qwen3_5"])          # ships the official template
    assert chat.template_source == str(QWEN35_PROTOCOL_TEMPLATE)
    assert "not prefix-preserving" in chat.source and "protocol template" in caplog.text
    # an explicit replacement is never swapped, and other model types are still refused
    with pytest.raises(ChatTemplateError, match="rewrites assistant content"):
        ChatTokenizer.from_dir(qwen35_hf["qwen3_5"],
                               chat_template_path=QWEN35_PROTOCOL_TEMPLATE.with_name("qwen3_5_official.jinja"))
    other = shutil.copytree(qwen35_hf["qwen3_5_text"], tmp_path / "m")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen3")))
    with pytest.raises(ChatTemplateError):
        ChatTokenizer.from_dir(other)


def _parity(capsys, model_dir, *args):
    rc = main(["parity", "logits", "--model", str(model_dir), "--batch", "4", "--seq", "24", *args])
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err, captured.err   # transformers' progress bar
    return rc, json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_text"])
def test_parity_logits_fp32_on_left_padded_batches(qwen35_hf, kind, capsys):
    """Against Qwen3_5ForConditionalGeneration (qwen3_5) and Qwen3_5ForCausalLM (qwen3_5_text)
    on a batch whose odd rows are left-padded: max |diff| <= 1e-4 on real tokens."""
    rc, out = _parity(capsys, qwen35_hf[kind])
    assert rc == 0 and out["ok"] and out["model_type"] == kind, out
    assert out["max_abs_diff"] <= 1e-4 and out["top1_agreement"] == 1.0


def test_parity_logits_over_three_chunks_with_strong_decays(qwen35_hf, capsys, tmp_path):
    """150 positions (chunks of 64, 64 and 22: the state crosses two chunk boundaries) with A
    drawn as transformers initialises it (exp(A_log) ~ U(0.01, 16), decays far stronger than
    the fixture's), against Qwen3_5ForCausalLM: max |diff| <= 1e-4 on real tokens."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(qwen35_hf["qwen3_5_text"], tmp_path / "strong")
    tensors = load_file(str(d / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("A_log")]:
        tensors[name] = torch.log(torch.empty(tensors[name].shape).uniform_(0.01, 16, generator=gen))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    rc, out = _parity(capsys, d, "--seq", "150")
    assert rc == 0 and out["ok"] and out["max_abs_diff"] <= 1e-4, out
    assert out["top1_agreement"] == 1.0


def test_parity_logits_bf16_on_the_released_storage(qwen35_hf, capsys):
    """The release layout (bf16 with fp32 A_log and gated norm, index naming
    model.safetensors-00001-of-00001.safetensors): mean KL <= 1e-3 in bf16."""
    rc, out = _parity(capsys, qwen35_hf["release"], "--dtype", "bfloat16", "--seed", "2")
    assert rc == 0 and out["ok"] and out["mean_kl"] <= 1e-3, out


def test_init_model_weights_are_what_transformers_reads(micro):
    from transformers import Qwen3_5ForConditionalGeneration

    from jscenegen.model.hf_io import hf_state_dict, load_hf

    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(micro).state_dict()
    ours = dict(hf_state_dict(load_hf(micro)))
    assert set(ours) - set(theirs) == {n for n in ours if n.startswith("mtp.")} != set()
    for name, arr in ours.items():
        if name in theirs:
            np.testing.assert_array_equal(arr, theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("size", ["0.8b", "4b", "9b", "27b"])
def test_mesh_report_on_the_released_shapes(size, capsys):
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.weights import param_shapes

    path = SHAPES / f"qwen3.5-{size}.json"
    assert main(["mesh-report", "--model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = QwenConfig.from_hf_dict(json.loads(path.read_text()))
    trained = param_shapes(cfg)
    every = param_shapes(cfg, carried=True)
    assert report["num_params"] == sum(int(np.prod(s)) for s in every.values())
    frozen = [r for r in report["params"] if not r["trained"]]
    assert {r["name"] for r in frozen} == set(every) - set(trained)
    assert all(r["name"].startswith(("model.visual.", "mtp.")) for r in frozen)
    carried = sum(int(np.prod(every[r["name"]])) for r in frozen)
    assert report["frozen_bytes"] == 2 * carried                       # bf16, no Adam
    assert report["total_bytes"] == 12 * (report["num_params"] - carried) + 2 * carried
    assert report["max_device_bytes"] <= 1.05 * report["ideal_device_bytes"]


@pytest.mark.parametrize("size", ["4b", "9b"])
def test_mesh_report_with_a_trained_vision_tower(size, capsys):
    """--train-vision (model.train_vision): the tower is fp32 + Adam (12 bytes per element),
    only mtp.* stays frozen in bf16; the fullest device still holds ~1/6 on fsdp=3,sp=2."""
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.weights import param_shapes

    path = SHAPES / f"qwen3.5-{size}.json"
    assert main(["mesh-report", "--model", str(path), "--json", "--train-vision"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = QwenConfig.from_hf_dict(json.loads(path.read_text()))
    trained = param_shapes(cfg, train_vision=True)
    assert any(n.startswith("model.visual.") for n in trained)
    frozen = {r["name"] for r in report["params"] if not r["trained"]}
    assert frozen and all(n.startswith("mtp.") for n in frozen)
    mtp = sum(int(np.prod(s)) for n, s in param_shapes(cfg, carried=True).items() if n in frozen)
    assert report["total_bytes"] == 12 * (report["num_params"] - mtp) + 2 * mtp
    assert report["max_device_bytes"] <= 1.05 * report["total_bytes"] / 6
