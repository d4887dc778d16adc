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


def test_the_export_files_a_training_state_reads_through_its_link_are_verified(exported,
                                                                               tmp_path, capsys):
    """The config at an export's root, read through `huggingface -> ../..`, was not hashed when
    the training state was the source: an altered one was converted without a word."""
    import shutil

    copy = tmp_path / "pub"
    shutil.copytree(exported["out"], copy, symlinks=True)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    src = copy / "training_state/global_step_3"
    assert main(["convert", str(src), str(tmp_path / "hf"), "--from", "verl", "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {copy / 'config.json'}: ") and err.endswith(
        f" ({copy / 'checksums.json'}; 1 file fails)\n"), err
    assert not (tmp_path / "hf").exists()


def test_inspect_export_and_orbax(exported):
    from convert.inspect import describe

    info = describe(exported["out"])
    assert info["format"] == "export" and info["hf"]["tensors"] == 24  # tied head not stored
    (ts,) = info["training_state"]
    assert ts["layout"] == "flattened" and ts["world_size"] == 6 and ts["adam_step"] == 3
    assert ts["placements"] == {"Shard(0)": 25} and ts["mesh"]["device_type"] == "cpu"
    assert ts["run_identity"] is None   # exported from a step converted from plain VERL files
    run = describe(exported["out"].parent / "run")
    assert run["format"] == "orbax-run" and run["steps"] == [3]
    assert run["latest"]["adam_count"] == 3 and run["latest"]["source"]["world_size"] == 6
    # the VERL source's per-rank extra states and per-tensor shard dims summarised, not listed
    source = run["latest"]["source"]
    extra = source["verl"]["extra_state"]
    assert extra["ranks"] == 6 and extra["lr_scheduler"]["last_epoch"] == 3 and extra["rng"] == ["cpu", "numpy", "random"]
    assert source["shard_dims"] == {"dim 0": 25}
    assert len(json.dumps(run)) < 4000


def test_convert_reads_its_source_format_from_the_file_names(exported, tmp_path, capsys):
    from convert.inspect import source_format

    run, pub = exported["out"].parent / "run", exported["out"]
    assert source_format(run) == "orbax" and source_format(next(run.iterdir())) == "orbax"
    assert source_format(exported["src"] / "ckpt") == "verl"
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert f"{run}: read as --from orbax" in capsys.readouterr().err
    assert source_format(tmp_path / "hf") == "hf"
    # an export holds an HF model and a VERL checkpoint: the user says which
    assert main(["convert", str(pub), str(tmp_path / "x"), "--to", "orbax"]) == 2
    err = capsys.readouterr().err.strip()
    state = pub / "training_state" / "global_step_3"
    assert err == (f"error: {pub}: an export; its root is an HF model (--from hf) and its "
                   f"training state a VERL checkpoint (convert {state})"), err
    assert not (tmp_path / "x").exists()
    assert main(["convert", str(state), str(tmp_path / "y"), "--to", "orbax"]) == 0
    assert f"{state}: read as --from verl" in capsys.readouterr().err
    assert main(["convert", str(pub), str(tmp_path / "w"), "--from", "hf", "--to", "orbax"]) == 0
    assert main(["convert", str(tmp_path), str(tmp_path / "z"), "--to", "hf"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_converting_an_export_carries_none_of_its_own_records(exported, tmp_path):
    """The export's huggingface/ links to its root, which holds checksums.json,
    checkpoint-layout.json and training_metadata.json: they describe the export, and were
    copied stale into the new huggingface/ (VERL) or root (HF)."""
    from convert.directions import verl_to_hf, verl_to_verl

    state = exported["out"] / "training_state" / "global_step_3"
    shard_dir = verl_to_verl(state, tmp_path / "verl", world_size=2, device_type="cpu")
    hf = sorted(p.name for p in (shard_dir / "huggingface").iterdir())
    assert hf == ["chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]
    verl_to_hf(state, tmp_path / "hf")
    assert not (tmp_path / "hf" / "training_metadata.json").exists()
    layout = json.loads((tmp_path / "hf" / "checkpoint-layout.json").read_text())
    assert layout["format"] == "hf-safetensors" and verify_checksums(tmp_path / "hf") > 0


# ---------------------------------------------------------------- Qwen3.5 VLM
@pytest.fixture(scope="module")
def exported35(tmp_path_factory):
    """The tied Qwen3.5 fixture with a frozen tower (mtp.* from its release) exported."""
    root = tmp_path_factory.mktemp("export35")
    src = fixture_dir("qwen35_tied_frozen_dim0")
    verl_to_orbax(src / "ckpt", root / "run", carried_from=src / "release")
    assert main(["export", str(root / "run"), str(root / "pub"), "--world-size", "6",
                 "--mesh-device", "cpu"]) == 0
    return {"out": root / "pub", "src": src,
            "params": load_file(str(src / "reference/params.safetensors")),
            "meta": json.loads((src / "reference/meta.json").read_text())}


def test_qwen35_published_layout(exported35):
    """The HF model at the root with the processor files beside it, every tensor of the
    release (tower, text, mtp.*) in it; the VERL training state without mtp.*."""
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files

    out = exported35["out"]
    assert verify_checksums(out) > 0
    root = sorted(p.name for p in out.iterdir() if p.is_file())
    assert root == sorted(["config.json", "generation_config.json", "model.safetensors",
                           "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                           "preprocessor_config.json", "video_preprocessor_config.json",
                           "training_metadata.json", "checkpoint-layout.json", "checksums.json"])
    for f in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (exported35["src"] / "release" / f).read_bytes(), f
    got = {n: read_tensor(f, n) for n, f in safetensors_files(out).items()}
    release = {n: read_tensor(f, n) for n, f in safetensors_files(exported35["src"] / "release").items()}
    assert set(got) == set(release)  # tied: no lm_head.weight in either
    for n, a in got.items():
        if n.startswith("mtp."):
            np.testing.assert_array_equal(a.view(np.uint16), release[n].view(np.uint16))
        else:
            np.testing.assert_array_equal(a, exported35["params"][n], err_msg=n)
    assert QwenConfig.from_dir(out).mtp_layers == 1
    meta = json.loads((out / "training_metadata.json").read_text())
    assert set(meta["frozen_tensors"]) == set(exported35["meta"]["frozen"]) | {
        n for n in release if n.startswith("mtp.")}


def test_qwen35_hf_root_loads_in_transformers(exported35):
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(exported35["out"], dtype=torch.float32)
    sd = model.state_dict()
    assert set(sd) == set(exported35["params"])
    for k, ref in exported35["params"].items():
        assert torch.equal(sd[k], torch.from_numpy(ref)), k


def test_qwen35_training_state_reads_back_with_mtp(exported35, tmp_path):
    """The training state: torch's tensors and Adam state (none for the frozen tower); its
    `huggingface` link is the root, whose weights give VERL -> HF the mtp.* with no flag."""
    from convert.directions import verl_to_hf
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files

    ck = VerlCheckpoint(exported35["out"] / "training_state")
    assert ck.frozen == exported35["meta"]["frozen"] and ck.adam_step() == 3
    for name, a in ck.iter_params(include_tied_alias=True):
        np.testing.assert_array_equal(a, exported35["params"][name], err_msg=name)
    verl_to_hf(exported35["out"] / "training_state", tmp_path / "hf")
    a = {n: read_tensor(f, n) for n, f in safetensors_files(tmp_path / "hf").items()}
    b = {n: read_tensor(f, n) for n, f in safetensors_files(exported35["out"]).items()}
    assert set(a) == set(b)
    for n in a:
        np.testing.assert_array_equal(a[n].view(np.uint8), b[n].view(np.uint8), err_msg=n)


@pytest.mark.slow
def test_qwen35_training_state_resumes_in_fsdp2(exported35, tmp_path):
    run_script(["load", str(exported35["out"] / "training_state/global_step_3"), str(tmp_path / "l"),
                "--world-size", "6", "--placement", "dim0", "--freeze-vision"])
    loaded = load_file(str(tmp_path / "l/loaded_params.safetensors"))
    for k, ref in exported35["params"].items():
        np.testing.assert_array_equal(loaded[k], ref, err_msg=k)
    meta = json.loads((tmp_path / "l/meta.json").read_text())
    assert meta["step_before"] == 3.0 and meta["step_after"] == 4.0
    assert meta["state_indices_loaded"] == exported35["meta"]["state_indices"]


def test_qwen35_inspect(exported35):
    from convert.inspect import describe

    info = describe(exported35["out"])
    frozen = len(exported35["meta"]["frozen"])
    (ts,) = info["training_state"]
    assert info["hf"]["tensors"] == 102 + 15 and info["hf"]["model_type"] == "qwen3_5"
    assert ts["tensors"] == 103 and ts["no_adam_state"] == frozen  # tied alias, no mtp.*
    assert ts["adam_state_tensors"] == 102 - frozen
    run = describe(exported35["out"].parent / "run")["latest"]
    assert run["tensors"] == 117 and run["frozen_tensors"] == frozen + 15
    assert run["adam_state_tensors"] == 102 - frozen


def test_a_checkpoint_whose_tokenizer_does_not_load_is_not_exported(exported, tmp_path, capsys):
    """A tokenizer.json of garbage (behind valid checksums) was published as it was, exit 0;
    transformers then failed to load the model's tokenizer (helper-83)."""
    import shutil

    from jscenegen.checkpoint.checksums import write_checksums

    run = tmp_path / "run"
    shutil.copytree(exported["out"].parent / "run", run, symlinks=True)
    [tokenizer] = run.rglob("hf/tokenizer.json")
    tokenizer.write_bytes(b"\xff\xfe garbage")
    write_checksums(tokenizer.parent.parent)
    assert main(["export", str(run), str(tmp_path / "pub"), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tokenizer}: not a tokenizer that tokenizers ")
    assert err.count("\n") == 1 and not (tmp_path / "pub").exists()
    # every conversion refuses it before it writes anything (the weights were streamed first)
    for to in ("hf", "verl"):
        args = ["--world-size", "2"] if to == "verl" else []
        assert main(["convert", str(run), str(tmp_path / to), "--to", to, *args]) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"error: {tokenizer}: not a tokenizer that ")
        assert not (tmp_path / to).exists()
    tokenizer.write_bytes((exported["out"] / "tokenizer.json").read_bytes())
    (tokenizer.parent / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    write_checksums(tokenizer.parent.parent)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"error: {tokenizer.parent / 'tokenizer_config.json'}: not valid JSON: ")


def test_export_refuses_its_output_before_it_hashes_the_checkpoint(exported, tmp_path, capsys):
    """An output that is not empty was refused only after the whole checkpoint was hashed
    (minutes on a large one): a damaged step was named instead of the output."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(exported["out"].parent / "run", run, symlinks=True)
    [params] = [p for p in run.rglob("*") if p.is_file() and p.stat().st_size > 4096][:1]
    data = bytearray(params.read_bytes())
    data[-1] ^= 0xFF
    params.write_bytes(bytes(data))
    out = tmp_path / "pub"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(out), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {out}: already exists and is not empty; choose a new destination\n"
    assert (out / "keep.txt").read_text() == "mine"
