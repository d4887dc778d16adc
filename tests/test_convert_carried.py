"""convert/tensor_sets.py and convert/carried.py: which tensors each format holds, and where
the ones a VERL checkpoint cannot hold (Qwen3.5's `mtp.*`) come from.

Sources are real producers: VERL shards saved by torch FSDP2 on 6 gloo ranks from transformers'
`Qwen3_5ForConditionalGeneration` (tests/fsdp_fixtures.py), and the release-layout directory
they started from (bf16 with fp32 A_log / gated norm, `mtp.*`, processor files,
`model.safetensors-00001-of-00001.safetensors` + index; tests/qwen35_fixtures.py).
"""
from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.directions import hf_to_verl, verl_to_hf
from convert.dispatch import convert
from convert.errors import ConversionWarning, ConvertError
from convert.tensor_sets import carried_names, config_json, hf_shapes, verl_absent, verl_shapes
from convert.verl_read import VerlCheckpoint
from jscenegen.model.config import QwenConfig
from jscenegen.model.safetensors_stream import read_tensor, safetensors_files, stored_tensors

from fsdp_fixtures import fixture_dir


@pytest.fixture(scope="module")
def untied():
    out = fixture_dir("qwen35_first_divisible")
    return {"ckpt": out / "ckpt", "release": out / "release",
            "params": load_file(str(out / "reference/params.safetensors"))}


def read_dir(hf_dir):
    """{name: array in its stored dtype} of every tensor of an HF directory."""
    return {n: read_tensor(f, n) for n, f in safetensors_files(hf_dir).items()}


def test_tensor_sets(untied, tiny_hf):
    cfg = QwenConfig.from_dir(untied["release"])
    hf, verl = hf_shapes(cfg), verl_shapes(cfg)
    absent = verl_absent(cfg)
    assert len(absent) == 15 and all(n.startswith("mtp.") for n in absent)
    assert list(verl) == [n for n in hf if n not in absent]  # same order, mtp.* left out
    assert list(verl)[0] == "model.visual.patch_embed.proj.weight" and list(verl)[-1] == "lm_head.weight"
    assert carried_names(cfg) == {n for n in hf if n.startswith(("model.visual.", "mtp."))}
    assert set(hf) == set(stored_tensors(untied["release"]))  # the release holds exactly these
    dense = QwenConfig.from_dir(tiny_hf["qwen3"])
    assert verl_shapes(dense) == hf_shapes(dense) and not verl_absent(dense)
    assert not carried_names(dense)
    # config.json of a directory without weights must say how many MTP layers it carries
    doc = json.loads((untied["release"] / "config.json").read_text())
    import dataclasses

    none = dataclasses.replace(cfg, mtp_layers=0)
    assert config_json(none, doc)["text_config"]["mtp_num_hidden_layers"] == 0
    assert config_json(cfg, doc)["text_config"]["mtp_num_hidden_layers"] == 1


def test_verl_to_hf_takes_mtp_from_the_release(untied, tmp_path):
    out = tmp_path / "hf"
    verl_to_hf(untied["ckpt"], out, carried_from=untied["release"])
    got, release = read_dir(out), read_dir(untied["release"])
    assert set(got) == set(release)  # vision tower, text, head, mtp.*
    for name, a in got.items():
        if name.startswith("mtp."):  # bit-exact, in the stored dtype (bf16)
            assert a.dtype == release[name].dtype == ml_dtypes.bfloat16, name
            np.testing.assert_array_equal(a.view(np.uint16), release[name].view(np.uint16))
        else:  # torch's full_tensor() of the fp32 master weights
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, untied["params"][name], err_msg=name)
    layout = json.loads((out / "checkpoint-layout.json").read_text())
    assert layout["carried_from"] == str(untied["release"]) and layout["dropped"] == []
    assert len(layout["carried_from_tensors"]) == 15
    cfg = QwenConfig.from_dir(out)
    assert cfg.mtp_layers == 1 and json.loads((out / "config.json").read_text()) == \
        json.loads((untied["ckpt"] / "global_step_3/actor/huggingface/config.json").read_text())
    from jscenegen.model.hf_io import iter_hf_tensors

    assert len(list(iter_hf_tensors(out))) == len(got)  # jscenegen's loader accepts every tensor


def test_dtype_casts_text_parameters_only(untied, tmp_path):
    import torch

    out = tmp_path / "bf16"
    verl_to_hf(untied["ckpt"], out, dtype="bfloat16", carried_from=untied["release"])
    got = read_dir(out)
    for name, a in got.items():
        if name.startswith("model.visual."):  # carried: the files' fp32, never cast
            assert a.dtype == np.float32, name
            np.testing.assert_array_equal(a, untied["params"][name])
        elif name.startswith("mtp."):
            assert a.dtype == ml_dtypes.bfloat16
        else:  # rounded as torch's .to(bfloat16)
            want = torch.from_numpy(untied["params"][name]).to(torch.bfloat16)
            assert a.dtype == ml_dtypes.bfloat16, name
            np.testing.assert_array_equal(a.view(np.int16), want.view(torch.int16).numpy())
    doc = json.loads((out / "config.json").read_text())   # transformers loads what it says
    assert doc["dtype"] == doc["text_config"]["dtype"] == "bfloat16"
    f32 = tmp_path / "fp32"
    verl_to_hf(untied["ckpt"], f32, dtype="float32", carried_from=untied["release"])
    doc = json.loads((f32 / "config.json").read_text())
    assert doc["dtype"] == doc["text_config"]["dtype"] == "float32"


def test_release_round_trip_through_verl(untied, tmp_path):
    """release (bf16, fp32 A_log and gated norm, mtp.*) -> VERL (model only) -> HF: every
    tensor and dtype of the release back, bit for bit."""
    verl = tmp_path / "verl"
    hf_to_verl(untied["release"], verl, world_size=6, placement="first-divisible",
               device_type="cpu")
    ck = VerlCheckpoint(verl)
    info = ck.tensor_info()
    release = read_dir(untied["release"])
    assert set(info) == {n for n in release if not n.startswith("mtp.")}
    assert {n for n, i in info.items() if i.dtype == "float32"} == {
        n for n in release if n.endswith(("linear_attn.A_log", "linear_attn.norm.weight"))}
    assert {i.shard_dim for i in info.values()} == {0, 1}
    layout = json.loads((verl / "checkpoint-layout.json").read_text())
    assert len(layout["not_in_verl"]) == 15
    out = tmp_path / "hf"
    names = verl_to_hf(verl, out, carried_from=untied["release"])
    got = read_dir(out)
    assert names == ["model.safetensors"] and set(got) == set(release)
    for name, a in release.items():
        assert got[name].dtype == a.dtype, name
        np.testing.assert_array_equal(got[name].view(np.uint8), a.view(np.uint8), err_msg=name)
    for f in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json",
              "chat_template.jinja", "tokenizer.json"):
        assert (out / f).read_bytes() == (untied["release"] / f).read_bytes(), f


def test_published_layout_carries_mtp_without_a_flag(untied, tmp_path):
    """`huggingface` -> ../.. with the HF model at the root (what `jscenegen export` writes):
    the root's weights supply mtp.*, no flag needed."""
    root = tmp_path / "published"
    shutil.copytree(untied["release"], root)
    step = root / "training_state" / "global_step_3"
    step.mkdir(parents=True)
    for f in (untied["ckpt"] / "global_step_3/actor").glob("*_world_size_*"):
        shutil.copy2(f, step / f.name)
    (step / "huggingface").symlink_to("../..", target_is_directory=True)
    out = tmp_path / "hf"
    verl_to_hf(root / "training_state" / "global_step_3", out)
    got, release = read_dir(out), read_dir(untied["release"])
    for name in verl_absent(QwenConfig.from_dir(untied["release"])):
        np.testing.assert_array_equal(got[name].view(np.uint16), release[name].view(np.uint16))
    np.testing.assert_array_equal(got["lm_head.weight"], untied["params"]["lm_head.weight"])


def test_refusals(untied, tmp_path):
    other = fixture_dir("qwen35_tied_frozen_dim0") / "release"  # hidden 44, not 48
    with pytest.raises(ConvertError, match=r"model\.safetensors-00001-of-00001\.safetensors: "
                                           r"model\.visual\.merger\.linear_fc2\.weight has shape"):
        verl_to_hf(untied["ckpt"], tmp_path / "a", carried_from=other)
    transformers_dir = tmp_path / "saved"  # what save_pretrained writes: no mtp.*
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(untied["release"]).save_pretrained(transformers_dir)
    with pytest.raises(ConvertError, match="holds no mtp"):
        verl_to_hf(untied["ckpt"], tmp_path / "b", carried_from=transformers_dir)
    with pytest.raises(ConvertError, match="--carried-from completes a VERL source"):
        convert(untied["release"], tmp_path / "c", src_format="hf", dst_format="verl",
                world_size=2, carried_from=untied["release"])
    with pytest.raises(ConvertError, match=r"^--carried-from \(an HF model directory\): "
                       rf"{tmp_path / 'nowhere' / 'config.json'}: no such file"):
        verl_to_hf(untied["ckpt"], tmp_path / "d", carried_from=tmp_path / "nowhere")
    dense = fixture_dir("qwen3_tied_dim0") / "ckpt"   # all its tensors are in VERL files: it was ignored
    with pytest.raises(ConvertError, match=r"^--carried-from completes a Qwen3.5 \(qwen3_5\) source; "
                                           "this one is qwen3"):
        verl_to_hf(dense, tmp_path / "e", carried_from=untied["release"])
    # a dense model given as the release: it said "holds no mtp.* tensors (written by transformers)"
    with pytest.raises(ConvertError, match=r"carried_from is a qwen3 model, not the Qwen3\.5 "
                                           r"\(qwen3_5\) the VERL checkpoint holds"):
        verl_to_hf(untied["ckpt"], tmp_path / "f", carried_from=dense / "global_step_3/actor/huggingface")
    for name in ("a", "b", "c", "d", "e", "f"):
        assert not (tmp_path / name).exists()


def test_without_a_source_mtp_is_dropped_with_a_warning(untied, tmp_path):
    with pytest.warns(ConversionWarning, match="--carried-from"):
        verl_to_hf(untied["ckpt"], tmp_path / "hf")
    assert not [n for n in read_dir(tmp_path / "hf") if n.startswith("mtp.")]
    assert QwenConfig.from_dir(tmp_path / "hf").mtp_layers == 0


def _perturbed_copy(release, dst, name):
    """A copy of the HF directory `release` with one bit of tensor `name` flipped: the same
    model by its shapes, another by its values."""
    shutil.copytree(release, dst)
    path = dst / safetensors_files(dst)[name].name
    raw = bytearray(path.read_bytes())
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    start = 8 + int.from_bytes(raw[:8], "little") + header[name]["data_offsets"][0]
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("source", ["frozen_tower", "model_only"])
def test_a_release_of_the_same_shapes_but_other_values_is_warned_about(untied, tmp_path, source):
    """Shapes alone accepted another model of the same size as carried_from (its mtp.* taken
    silently). The tensors the run never trained must match it: those without Adam state, or
    the vision tower of a model-only checkpoint."""
    import warnings

    if source == "frozen_tower":
        fixture = fixture_dir("qwen35_tied_frozen_dim0")
        ckpt, release = fixture / "ckpt", fixture / "release"
        assert VerlCheckpoint(ckpt).frozen   # the tower has no Adam state
    else:
        ckpt, release = tmp_path / "verl", untied["release"]
        hf_to_verl(release, ckpt, world_size=2, device_type="cpu")
        assert not VerlCheckpoint(ckpt).has_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)
        verl_to_hf(ckpt, tmp_path / "same", carried_from=release)
    first = next(iter(verl_shapes(QwenConfig.from_dir(release))))
    other = _perturbed_copy(release, tmp_path / "other", first)
    with pytest.warns(ConversionWarning, match=rf"carried_from's {first} differs from the "
                                              r"checkpoint's.*the release the run started from"):
        verl_to_hf(ckpt, tmp_path / "out", carried_from=other)
