"""`jscenegen export`: the published layout, verified, loadable by transformers, resumable."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.orbax_directions import verl_to_orbax
from convert.verl_read import VerlCheckpoint
from jscenegen.checkpoint.checksums import verify_checksums
from jscenegen.cli import main

from fsdp_fixtures import fixture_dir, run_script


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    src = fixture_dir("qwen3_tied_dim0")
    verl_to_orbax(src / "ckpt", root / "run")
    assert main(["export", str(root / "run"), str(root / "pub"), "--world-size", "6",
                 "--mesh-device", "cpu"]) == 0
    return {"out": root / "pub", "src": src,
            "params": load_file(str(src / "reference/params.safetensors"))}


def test_layout_and_checksums(exported):
    out = exported["out"]
    assert verify_checksums(out) > 0
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()
                   and not p.is_symlink() and "huggingface" not in p.parts)
    expected_root = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja", "training_metadata.json", "checkpoint-layout.json",
                     "checksums.json"}
    step = "training_state/global_step_3"
    expected = expected_root | {"training_state/latest_checkpointed_iteration.txt",
                                f"{step}/fsdp_config.json"} | {
        f"{step}/{k}_world_size_6_rank_{r}.pt" for k in ("model", "optim", "extra_state")
        for r in range(6)}
    assert set(names) == expected  # nothing else: no trajectories, prompts or logs
    link = out / step / "huggingface"
    assert link.is_symlink() and str(link.readlink()) == "../.."
    meta = json.loads((out / "training_metadata.json").read_text())
    assert meta["optimizer_step"] == 3 and meta["source"]["format"] == "verl"
    layout = json.loads((out / "checkpoint-layout.json").read_text())
    assert layout["format"] == "published" and layout["training_state"]["world_size"] == 6


def test_hf_root_loads_in_transformers(exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported["out"], dtype=torch.float32)
    sd = model.state_dict()
    for k, ref in exported["params"].items():
        assert torch.equal(sd[k], torch.from_numpy(ref)), k
    tok = AutoTokenizer.from_pretrained(exported["out"])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_training_state_reads_back(exported):
    ck = VerlCheckpoint(exported["out"] / "training_state")
    assert ck.layout.kind == "run" and ck.world_size == 6 and ck.adam_step() == 3
    assert ck.hf_dir.resolve() == exported["out"].resolve()
    for name, a in ck.iter_params(include_tied_alias=True):
        np.testing.assert_array_equal(a, exported["params"][name], err_msg=name)


@pytest.mark.slow
def test_training_state_resumes_in_fsdp2(exported, tmp_path):
    run_script(["load", str(exported["out"] / "training_state/global_step_3"), str(tmp_path / "l"),
                "--world-size", "6", "--placement", "dim0"])
    loaded = load_file(str(tmp_path / "l/loaded_params.safetensors"))
    for k, ref in exported["params"].items():
        np.testing.assert_array_equal(loaded[k], ref, err_msg=k)
    meta = json.loads((tmp_path / "l/meta.json").read_text())
    assert meta["step_before"] == 3.0 and meta["step_after"] == 4.0 and meta["last_epoch_after"] == 4


def test_inspect_export_and_orbax(exported):
    from convert.inspect import describe

    info = describe(exported["out"])
    assert info["format"] == "export" and info["hf"]["tensors"] == 24  # tied head not stored
    (ts,) = info["training_state"]
    assert ts["layout"] == "flattened" and ts["world_size"] == 6 and ts["adam_step"] == 3
    assert ts["placements"] == {"Shard(0)": 25} and ts["mesh"]["device_type"] == "cpu"
    run = describe(exported["out"].parent / "run")
    assert run["format"] == "orbax-run" and run["steps"] == [3]
    assert run["latest"]["adam_count"] == 3 and run["latest"]["source"]["world_size"] == 6
