"""verl -> hf and hf -> verl (convert/directions.py, convert/safetensors_io.py).

Ground truth: torch's own `full_tensor()` of the FSDP2 fixture (tests/fsdp_fixtures.py), and
transformers loading what we wrote. The Qwen3.5 fixtures' `mtp.*` (which VERL files cannot
hold) are covered by tests/test_convert_carried.py; here no reference is given, so they are
dropped with a warning.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.directions import hf_to_verl, verl_to_hf
from convert.errors import ConvertError
from convert.verl_read import VerlCheckpoint
from jscenegen.checkpoint.checksums import verify_checksums

from fsdp_fixtures import GLOBAL_STEP, fixture_dir

NAMES = ("qwen2_first_divisible", "qwen3_tied_dim0", "qwen35_first_divisible",
         "qwen35_tied_frozen_dim0")


@pytest.fixture(scope="session", params=NAMES)
def fixture(request):
    out = fixture_dir(request.param)
    meta = json.loads((out / "reference/meta.json").read_text())
    return {"ckpt": out / "ckpt", "params": load_file(str(out / "reference/params.safetensors")),
            "tied": len(meta["state_dict_keys"]) > len(meta["param_order"]),
            "qwen35": request.param.startswith("qwen35")}


@pytest.fixture(scope="session")
def hf_out(fixture, tmp_path_factory):
    from convert.errors import ConversionWarning

    out = tmp_path_factory.mktemp("hf") / "model"
    if fixture["qwen35"]:
        with pytest.warns(ConversionWarning, match=r"15 mtp\.\* tensors"):
            verl_to_hf(fixture["ckpt"], out)
    else:
        verl_to_hf(fixture["ckpt"], out)
    return out


def model_class(hf_dir):
    """The transformers class VERL trains for this directory (the VLM for qwen3_5)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    qwen35 = json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_5"
    return AutoModelForImageTextToText if qwen35 else AutoModelForCausalLM


def _read_all(hf_dir):
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(hf_dir / f)))
    return out


def test_verl_to_hf_equals_torch_full_state_dict(fixture, hf_out):
    ref = fixture["params"]
    got = _read_all(hf_out)
    expected = set(ref) - ({"lm_head.weight"} if fixture["tied"] else set())
    assert set(got) == expected  # the tied alias is dropped, as VERL 0.9's merger does
    for k, a in got.items():
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, ref[k], err_msg=k)
    assert verify_checksums(hf_out) >= 3
    layout = json.loads((hf_out / "checkpoint-layout.json").read_text())
    assert layout["source_format"] == "verl" and len(layout["files"][0]["source"]) == 6
    if fixture["qwen35"]:  # no mtp source: dropped, and the config says so
        assert len(layout["dropped"]) == 15 and layout["carried_from"] is None
        cfg = json.loads((hf_out / "config.json").read_text())
        assert cfg["text_config"]["mtp_num_hidden_layers"] == 0
        assert (hf_out / "preprocessor_config.json").is_file()


def test_transformers_loads_the_output_bitwise(fixture, hf_out):
    import torch

    model = model_class(hf_out).from_pretrained(hf_out, dtype=torch.float32)
    sd = model.state_dict()
    ref = fixture["params"]
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k], torch.from_numpy(ref[k])), k  # lm_head re-tied when tied


def test_bf16_and_sharded_output(tmp_path):
    """--dtype bfloat16 rounds as torch's .to(bfloat16); small shards get an index json."""
    import torch

    src = fixture_dir("qwen2_first_divisible")
    ref = load_file(str(src / "reference/params.safetensors"))
    out = tmp_path / "bf16"
    names = verl_to_hf(src / "ckpt", out, dtype="bfloat16", max_shard_bytes=40_000)
    assert len(names) > 2 and names[-1] == "model.safetensors.index.json"
    from safetensors.torch import load_file as load_torch

    index = json.loads((out / names[-1]).read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_torch(str(out / f)))
    assert set(got) == set(ref) and index["metadata"]["total_size"] == sum(
        t.numel() * 2 for t in got.values())
    for k, t in got.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, torch.from_numpy(ref[k]).to(torch.bfloat16)), k
    # config.json says so: transformers loads the weights in the dtype it names
    from transformers import AutoConfig

    assert json.loads((src / f"ckpt/global_step_{GLOBAL_STEP}/actor/huggingface/config.json").read_text()).get(
        "torch_dtype", "float32") == "float32"
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16


def test_hf_to_verl_model_only(fixture, hf_out, tmp_path):
    out = tmp_path / "verl"
    hf_to_verl(hf_out, out, world_size=4, placement="first-divisible", device_type="cpu")
    ck = VerlCheckpoint(out)
    assert ck.layout.kinds == ("model",) and ck.world_size == 4 and ck.layout.global_step == 0
    ref = fixture["params"]
    for name, a in ck.iter_params(include_tied_alias=True):
        np.testing.assert_array_equal(a, ref[name], err_msg=name)
    assert {i.shard_dim for i in ck.tensor_info().values()} == {0, 1}  # 48 % 4 == 0: Shard(1) exists
    assert verify_checksums(out) > 0
    # VERL's default load_contents (model, optimizer, extra) opens the files not written: the
    # layout says what VERL must load, and the command says how to resume from it
    assert json.loads((out / "checkpoint-layout.json").read_text())["load_contents"] == ["model"]


def test_the_hf_to_verl_command_says_how_verl_resumes_a_model_only_output(tiny_hf, tmp_path, capsys):
    from jscenegen.cli import main

    out = tmp_path / "verl"
    assert main(["convert", str(tiny_hf["qwen3"]), str(out), "--from", "hf", "--to", "verl",
                 "--world-size", "2", "--mesh-device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("note: model rank files only (no optim_ or extra_state_ files): VERL's resume loads "
            "model, optimizer and extra state by default and fails on the missing files; resume "
            "from it with actor_rollout_ref.actor.checkpoint.load_contents=[model] (fresh AdamW "
            "and LR schedule from the run's config), or start VERL from the HF model itself") in err
    assert sorted(p.name.partition("_world_size_")[0] for p in
                  (out / "global_step_0" / "actor").glob("*.pt")) == ["model", "model"]


def test_hf_to_verl_from_transformers_dir(tiny_hf, tmp_path):
    """A directory written by transformers' save_pretrained (tied qwen3: no lm_head saved)."""
    src = tiny_hf["qwen3"]
    ref = load_file(str(src / "model.safetensors"))
    out = tmp_path / "verl"
    hf_to_verl(src, out, world_size=6, device_type="cpu")
    got = dict(VerlCheckpoint(out).iter_params(include_tied_alias=True))
    assert got.keys() == set(ref) | {"lm_head.weight"}
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    np.testing.assert_array_equal(got["lm_head.weight"], ref["model.embed_tokens.weight"])


def test_hf_to_verl_refuses_a_misshaped_tensor(tiny_hf, tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "bad"
    src.mkdir()
    (src / "config.json").write_text((tiny_hf["qwen2"] / "config.json").read_text())
    tensors = load_file(str(tiny_hf["qwen2"] / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].copy()
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"model\.safetensors: model\.norm\.weight has shape"):
        hf_to_verl(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()
