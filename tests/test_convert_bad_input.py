"""Refusals: missing rank files, contradicting world sizes, truncated files, hostile pickles.

Each must raise ConvertError naming the file, and leave nothing at the destination (the
output is staged in a temp directory and only renamed into place when complete).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from convert.directions import verl_to_hf, verl_to_verl
from convert.errors import ConvertError
from convert.torch_safe import load_pt

from fsdp_fixtures import fixture_dir


@pytest.fixture
def actor(tmp_path):
    """A private copy of the qwen3 fixture's actor/ directory, to damage."""
    src = fixture_dir("qwen3_tied_dim0") / "ckpt" / "global_step_3" / "actor"
    dst = tmp_path / "global_step_3" / "actor"
    shutil.copytree(src, dst)
    return dst


def _assert_nothing_written(parent, name="out"):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.partial-")]


def test_missing_rank_file(actor, tmp_path):
    (actor / "model_world_size_6_rank_3.pt").unlink()
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_3\.pt: missing"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_world_size_no_checkpoint_has_is_refused_without_counting_to_it(tmp_path):
    """A file name claiming W = 99,999,999,999: refused naming the file (building the set of
    its W ranks took all memory); a W within bounds with one file lists the first absent ranks."""
    from convert.verl_read import find_verl

    d = tmp_path / "global_step_1"
    d.mkdir()
    (d / "model_world_size_99999999999_rank_0.pt").write_bytes(b"")
    with pytest.raises(ConvertError, match=r"model_world_size_99999999999_rank_0\.pt: world size "
                                           r"99,999,999,999 is above 8,192"):
        find_verl(d)
    (d / "model_world_size_99999999999_rank_0.pt").rename(d / "model_world_size_8192_rank_5.pt")
    with pytest.raises(ConvertError, match=r"model_world_size_8192_rank_0\.pt: missing \(8191 of "
                                           r"8192 model rank files absent: ranks 0, 1, 2, 3, \.\.\.\)"):
        find_verl(d)


def test_world_size_contradicted_by_fsdp_config(actor, tmp_path):
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    with pytest.raises(ConvertError, match=r"fsdp_config\.json: world_size 4 contradicts"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_rank_files_of_two_world_sizes(actor, tmp_path):
    shutil.copy(actor / "model_world_size_6_rank_0.pt", actor / "model_world_size_3_rank_0.pt")
    with pytest.raises(ConvertError, match=r"several world sizes \[3, 6\]"):
        verl_to_hf(actor, tmp_path / "out")


def test_mesh_size_contradicts_file_count(actor, tmp_path):
    """Six files renamed as if W were 5 (rank 5 dropped): the DTensor meshes say 6."""
    for kind in ("model", "optim", "extra_state"):
        (actor / f"{kind}_world_size_6_rank_5.pt").unlink()
        for r in range(5):
            os.replace(actor / f"{kind}_world_size_6_rank_{r}.pt", actor / f"{kind}_world_size_5_rank_{r}.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 5}))
    with pytest.raises(ConvertError, match=r"model_world_size_5_rank_0\.pt: .* mesh has 6 ranks"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("kind", ["model", "extra_state"])
def test_truncated_file(actor, tmp_path, kind):
    """A truncated extra_state file passed `--to hf` (which reads none of them) while a
    missing one was refused: every present rank file must be a complete archive."""
    f = actor / f"{kind}_world_size_6_rank_2.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match=rf"{kind}_world_size_6_rank_2\.pt: refused: not a "
                       "complete torch zip archive"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_an_unreadable_rank_file_is_named_unreadable(actor, tmp_path, monkeypatch):
    """A rank file the user may not read was reported as a truncated archive. (The tests run as
    root, whom chmod does not stop: the refusal of `open` is simulated.)"""
    import builtins

    import convert.torch_safe

    locked = actor / "optim_world_size_6_rank_1.pt"

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(locked):
            raise PermissionError(13, "Permission denied", str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(convert.torch_safe, "open", refusing_open, raising=False)
    with pytest.raises(ConvertError, match=r"optim_world_size_6_rank_1\.pt: unreadable "
                                           r"\(Permission denied\)$"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


class _Payload:
    """Pickles as a call to os.system: what an untrusted checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_arbitrary_object_is_refused(actor, tmp_path):
    import torch

    marker = tmp_path / "pwned"
    f = actor / "extra_state_world_size_6_rank_4.pt"
    extra = load_pt(f, mmap=False)  # never rewrite a file that is memory-mapped
    extra["rng"]["payload"] = _Payload(marker)
    torch.save(extra, f)
    with pytest.raises(ConvertError, match=r"extra_state_world_size_6_rank_4\.pt: refused .*system"):
        verl_to_verl(actor, tmp_path / "out", world_size=6)
    assert not marker.exists()
    _assert_nothing_written(tmp_path)


def test_model_file_with_arbitrary_object_is_refused(actor, tmp_path):
    import torch

    marker = tmp_path / "pwned"
    f = actor / "model_world_size_6_rank_0.pt"
    sd = load_pt(f, mmap=False)  # never rewrite a file that is memory-mapped
    sd["evil"] = _Payload(marker)
    torch.save(sd, f)
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_0\.pt: refused"):
        verl_to_hf(actor, tmp_path / "out")
    assert not marker.exists()


def test_numpy_object_array_is_refused(tmp_path):
    import torch

    f = tmp_path / "extra.pt"
    torch.save({"rng": {"numpy": ("MT19937", np.array([1, "x"], dtype=object), 0, 0, 0.0)}}, f)
    with pytest.raises(ConvertError, match=r"extra\.pt: "):
        load_pt(f)


def test_unexpected_tensor_names(actor, tmp_path):
    import torch

    f = actor / "model_world_size_6_rank_1.pt"
    sd = load_pt(f, mmap=False)  # never rewrite a file that is memory-mapped
    sd["model.extra.weight"] = sd.pop("model.norm.weight")
    torch.save(sd, f)
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_1\.pt: keys do not match"):
        verl_to_hf(actor, tmp_path / "out")


def test_a_rank_file_copied_over_another_is_refused(actor, tmp_path, capsys):
    """`cp rank_0 rank_1`: every shard still has the size rank 1's would have, but its DTensor
    was saved by rank 0 (at rank 0's offset); converting would write wrong weights."""
    from jscenegen.cli import main

    shutil.copy(actor / "model_world_size_6_rank_0.pt", actor / "model_world_size_6_rank_1.pt")
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_1\.pt: holds the shard of "
                                           r"rank 0 .*not of rank 1"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)
    assert main(["convert", str(actor), str(tmp_path / "out"), "--from", "verl", "--to", "hf"]) == 2
    assert "model_world_size_6_rank_1.pt: holds the shard of rank 0" in capsys.readouterr().err
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_a_copied_rank_file_is_refused_before_any_write_in_every_direction(actor, tmp_path, capsys,
                                                                           kind):
    """The rank-file set is checked when the checkpoint is opened, before a direction writes:
    the orbax direction (threads writing as tensors are read) then fails with one line too."""
    from convert.verl_read import VerlCheckpoint
    from jscenegen.cli import main

    shutil.copy(actor / f"{kind}_world_size_6_rank_1.pt", actor / f"{kind}_world_size_6_rank_2.pt")
    with pytest.raises(ConvertError, match=rf"{kind}_world_size_6_rank_2\.pt: holds the shard of "
                                           r"rank 1 .*not of rank 2"):
        VerlCheckpoint(actor)
    for to in ("orbax", "hf", "verl"):
        out = tmp_path / f"out-{to}"
        ranks = ["--world-size", "2"] if to == "verl" else []
        assert main(["convert", str(actor), str(out), "--from", "verl", "--to", to, *ranks]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{kind}_world_size_6_rank_2.pt: holds the shard" in err, err
        _assert_nothing_written(tmp_path, out.name)


def _flip_tensor_byte(f, record=None):
    """Flip one bit in the middle of the largest tensor storage of torch file `f` (a zip), or
    of the zip record named `record`."""
    import struct
    import zipfile

    with zipfile.ZipFile(f) as z:
        info = (z.getinfo(record) if record else
                max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size))
    data = bytearray(f.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_a_flipped_bit_without_checksums_fails_the_zip_crc(actor, tmp_path):
    """VERL writes no checksums.json: the CRC-32 each zip record carries catches a corrupted
    storage as it is read (it converted silently and the output's checksums vouched for it)."""
    from convert.orbax_directions import verl_to_orbax

    f = actor / "model_world_size_6_rank_1.pt"
    _flip_tensor_byte(f)
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_1\.pt: \S+weight: its bytes "
                                           r"fail the CRC-32 the file records for them \(\S+/data/\d+\); "
                                           r"the file is corrupt"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)
    _flip_tensor_byte(f)                                   # mended: converts
    g = actor / "optim_world_size_6_rank_3.pt"
    _flip_tensor_byte(g)
    with pytest.raises(ConvertError, match=r"optim_world_size_6_rank_3\.pt: state\[\d+\]\.exp_avg"):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_source_that_fails_its_checksums_is_refused_before_converting(actor, tmp_path_factory):
    from convert.dispatch import convert
    from jscenegen.checkpoint.checksums import write_checksums

    root = actor.parent.parent  # global_step_3/actor/... listed by a checksums.json two levels up
    write_checksums(root)
    out = tmp_path_factory.mktemp("dst")   # outside the checksummed tree (refused inside it)
    f = actor / "optim_world_size_6_rank_2.pt"
    _flip_tensor_byte(f)  # the file still loads: only the checksums can tell
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(f))}: SHA-256 differs "
                                           rf"\({re.escape(str(root / 'checksums.json'))}; 1 file fails\)$"):
        convert(actor, out / "out", src_format="verl", dst_format="verl", world_size=6)
    _assert_nothing_written(out)
    (root / "checksums.json").unlink()
    write_checksums(root)  # the same bytes, now listed as they are: converted
    convert(actor, out / "out", src_format="verl", dst_format="hf")
    assert (out / "out" / "config.json").is_file()
    with pytest.raises(ConvertError, match=r"lies inside the checkpoint"):   # would break it
        convert(actor, root / "out", src_format="verl", dst_format="hf")


def test_a_truncated_safetensors_file_is_refused_before_orbax_writes(tiny_hf, tmp_path):
    from convert.orbax_directions import hf_to_orbax

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConvertError, match=r"model\.safetensors: truncated: \d+ tensor\(s\) end beyond"):
        hf_to_orbax(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["../elsewhere/model.safetensors", "/abs/model.safetensors",
                                   "sub/model.safetensors", ".."])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tiny_hf, tmp_path, where):
    """The index could read weights from anywhere on the disk (an absolute or `../` path)."""
    from safetensors.numpy import load_file

    from convert.directions import hf_to_verl

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    shard = (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    names = list(load_file(str(shard)))
    weight_map = {n: shard.name for n in names}
    weight_map[names[0]] = where
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json: weight_map\['{re.escape(names[0])}'\] "
                                           rf"is '{re.escape(where)}'; a shard is a file name"):
        hf_to_verl(src, tmp_path / "out", world_size=2)
    _assert_nothing_written(tmp_path)


def test_an_index_that_leaves_a_held_tensor_out_says_so(tiny_hf, tmp_path):
    """convert blamed config.json ("names do not match"); the loader already named the index."""
    from safetensors.numpy import load_file

    from convert.directions import hf_to_verl

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    shard = (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    names = sorted(load_file(str(shard)))
    weight_map = {n: shard.name for n in names[1:]}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConvertError, match=rf"model\.safetensors\.index\.json: {shard.name} holds tensor "
                                           rf"'{re.escape(names[0])}', which weight_map does not list"):
        hf_to_verl(src, tmp_path / "out", world_size=2)
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("index,why", [
    ({"weight_map": {"model.norm.weight": 5}}, r"weight_map\['model\.norm\.weight'\] is 5; a shard is a file name \(a string\)"),
    ("[" * 100_000 + "]" * 100_000, r"not valid JSON: nested too deeply"),
    ('{"weight_map": {"a": ' + "1" * 5000 + "}}", r"not valid JSON: an integer of more than 4,300 digits"),
    (b'{"weight_map": "\xe9"}', r"not valid JSON: 'utf-8' codec can't decode"),
    ({"metadata": {}}, r"malformed index: it needs a 'weight_map' object \(tensor name -> shard file\), got None"),
    ({"weight_map": ["model.safetensors"]}, r"malformed index: it needs a 'weight_map' object .*got \['model\.safetensors'\]"),
    ('{"weight_map": {"model.norm.weight": "a.safetensors", "model.norm.weight": "model.safetensors"}}',
     r"not valid JSON: the key 'model\.norm\.weight' appears twice in one object")])
def test_a_malformed_index_is_named(tiny_hf, tmp_path, index, why):
    """A number where a shard's file name belongs was read as the file "5"; a deeply nested or
    non-UTF-8 index ended in a traceback."""
    from convert.directions import hf_to_verl

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")   # the index is read
    data = index if isinstance(index, bytes) else (index if isinstance(index, str) else json.dumps(index)).encode()
    (src / "model.safetensors.index.json").write_bytes(data)
    with pytest.raises(ValueError, match=rf"^{src}/model\.safetensors\.index\.json: {why}"):
        hf_to_verl(src, tmp_path / "out", world_size=2)
    _assert_nothing_written(tmp_path)


def test_hf_to_orbax_names_the_source_without_a_tokenizer(tmp_path):
    from convert.orbax_directions import hf_to_orbax

    from hf_fixtures import make_hf_dir

    src = make_hf_dir(tmp_path / "hf", "qwen3")
    assert not (src / "tokenizer.json").exists()
    with pytest.raises(ConvertError, match=rf"^{src}: no tokenizer") as err:
        hf_to_orbax(src, tmp_path / "out")
    assert "jscenegen-hf-assets" not in str(err.value)
    _assert_nothing_written(tmp_path)


def test_inputs_that_are_not_regular_files_are_named_as_what_they_are(actor, tmp_path):
    """A rank file, VERL's step pointer or fsdp_config.json that is a named pipe read as
    "file not found" or "no rank files"; a tokenizer.json that is one as "no tokenizer"."""
    from convert.orbax_directions import hf_to_orbax
    from convert.verl_read import find_verl

    from hf_fixtures import make_hf_dir

    (actor / "fsdp_config.json").unlink()
    os.mkfifo(actor / "fsdp_config.json")
    with pytest.raises(ConvertError, match=r"fsdp_config\.json: is a named pipe$"):
        find_verl(actor)
    rank = actor / "model_world_size_6_rank_3.pt"
    rank.unlink()
    os.mkfifo(rank)
    with pytest.raises(ConvertError, match=rf"^{rank}: is a named pipe"):
        load_pt(rank)
    with pytest.raises(ConvertError, match=rf"^{rank}: is a named pipe"):
        find_verl(actor)
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "latest_checkpointed_iteration.txt")
    with pytest.raises(ConvertError, match=r"latest_checkpointed_iteration\.txt: is a named pipe$"):
        find_verl(run)
    src = make_hf_dir(tmp_path / "hf", "qwen3")
    os.mkfifo(src / "tokenizer.json")
    with pytest.raises(ConvertError, match=rf"^{src / 'tokenizer.json'}: is a named pipe$"):
        hf_to_orbax(src, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def _edit(f, change):
    import torch

    sd = load_pt(f, mmap=False)  # never rewrite a file that is memory-mapped
    change(sd)
    torch.save(sd, f)


def _edit_every_rank(actor, kind: str, change):
    for r in range(6):
        _edit(actor / f"{kind}_world_size_6_rank_{r}.pt", change)


def _shared_list(levels: int) -> list:
    """A list of two references to one list, `levels` deep: 2^levels leaves written out."""
    nested: list = []
    for _ in range(levels):
        nested = [nested, nested]
    return nested


def test_a_shared_container_in_a_pickle_is_walked_once(tmp_path):
    """A few KB whose shared lists expand to 2^30 leaves when walked as a tree: each list is
    checked once (the RNG state's own check then refuses it); nesting past 32 is refused."""
    import torch

    nested = _shared_list(30)
    f = tmp_path / "extra_state_world_size_1_rank_0.pt"
    torch.save({"rng": {"numpy": nested}, "lr_scheduler": None}, f)
    assert f.stat().st_size < 10_000
    loaded = load_pt(f)["rng"]["numpy"]          # seconds, not the hours of a tree walk
    assert loaded[0] is loaded[1]
    deep = {"rng": {"random": [[[]]] * 3}}
    for _ in range(40):
        deep = {"x": deep}
    torch.save(deep, f)
    with pytest.raises(ConvertError, match="nesting deeper than 32 levels"):
        load_pt(f)


@pytest.mark.parametrize("kind,change,message", [
    ("optim", lambda sd: sd["state"][0].__setitem__("step", __import__("torch").tensor(float("inf"))),
     r"optim_world_size_6_rank_0\.pt: state\[0\]\.step is tensor\(inf\), expected one finite number"),
    ("optim", lambda sd: sd["state"][0].__setitem__("step", __import__("torch").tensor([1.0, 2.0])),
     r"state\[0\]\.step is tensor\(\[1\., 2\.\]\)"),
    ("optim", lambda sd: sd.__setitem__("state", list(sd["state"].values())),
     r"state is a list, expected a dict of parameter index"),
    ("optim", lambda sd: sd.__setitem__("param_groups", [1, 2]),
     r"param_groups must be a list of dicts"),
    ("extra_state", lambda sd: sd["lr_scheduler"].pop("last_epoch"),
     r"extra_state_world_size_6_rank_0\.pt: lr_scheduler\.last_epoch is None, expected an integer"),
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__("_last_lr", _shared_list(30)),
     r"lr_scheduler holds more than 100,000 values or nests deeper than 6 levels"),
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__("_last_lr", [[0.0] * 1000] * 1000),
     r"lr_scheduler holds more than 100,000 values"),
    ("optim", lambda sd: sd["param_groups"][0].__setitem__("betas", _shared_list(25)),
     r"optim_world_size_6_rank_0\.pt: param_groups holds more than 100,000 values or nests"),
    # a step outside the int32 counters: written out as global_step_-5 (unreadable back) or
    # an orbax step 10^20 that no resume could restore
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__("last_epoch", -5),
     r"rank_0\.pt: lr_scheduler\.last_epoch is -5, expected an integer in 0\.\.2147483647"),
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__("last_epoch", 10 ** 20),
     r"lr_scheduler\.last_epoch is 100000000000000000000, expected an integer in 0\.\.2147483647"),
    ("extra_state", lambda sd: sd["rng"].__setitem__("numpy", ("MT19937", 1)),
     r"rng\['numpy'\] is not numpy\.random\.get_state\(\)'s 5-tuple"),
    ("extra_state", lambda sd: sd["rng"].__setitem__("random", [3, [1], None]),
     r"rng\['random'\] is not random\.getstate\(\)'s 3-tuple"),
    # a state torch.set_rng_state refuses: carried into new VERL files, it broke the resume
    ("extra_state", lambda sd: sd["rng"].__setitem__("cpu", sd["rng"]["cpu"][:3].clone()),
     r"rng\['cpu'\] is not a torch uint8 generator state of 5056 bytes"),
    ("extra_state", lambda sd: sd["rng"].__setitem__("numpy", ("MT19937", sd["rng"]["numpy"][1][:3],
                                                                0, 0, 0.0)),
     r"rng\['numpy'\] is not numpy\.random\.get_state\(\)'s 5-tuple \('MT19937', 624 key words"),
    # VERL's load_rng_state reads cpu, numpy and random without a fallback: KeyError on resume
    ("extra_state", lambda sd: sd["rng"].pop("random"),
     r"extra_state_world_size_6_rank_0\.pt: rng has no 'random' state \('cpu', 'numpy' only\); "
     r"VERL saves and, on resume, restores cpu, numpy, random \(and its device's\) without a "
     r"fallback$"),
    # AMSGrad's extra moment, or its flag: converted, the state lost max_exp_avg_sq silently
    # and the VERL files written back made torch's step() raise KeyError
    ("optim", lambda sd: sd["state"][0].__setitem__("max_exp_avg_sq", sd["state"][0]["exp_avg_sq"]),
     r"rank_0\.pt: state\[0\] also holds \['max_exp_avg_sq'\] \(AMSGrad"),
    ("optim", lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True),
     r"rank_0\.pt: param_groups\[0\]\.amsgrad is True; only plain AdamW state"),
    ("optim", lambda sd: sd["param_groups"][0].__setitem__("maximize", True),
     r"param_groups\[0\]\.maximize is True"),
])
def test_malformed_optimizer_or_extra_state_fields_are_named(actor, tmp_path, kind, change, message):
    from convert.orbax_directions import verl_to_orbax

    _edit(actor / f"{kind}_world_size_6_rank_0.pt", change)
    with pytest.raises(ConvertError, match=message):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("kind,change,message", [
    # values JSON cannot hold, named by file and key (a 2-element tensor was a RuntimeError
    # traceback when the ranks' scheduler states were compared; a NaN never equals itself)
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__(
        "base_lrs", [__import__("torch").tensor([1e-3, 2e-3])]),
     r"rank_0\.pt: lr_scheduler\['base_lrs'\]\[0\] is a Tensor; a conversion to orbax copies "
     r"lr_scheduler into JSON metadata"),
    ("extra_state", lambda sd: sd["lr_scheduler"].__setitem__("_last_lr", [float("nan")]),
     r"rank_0\.pt: lr_scheduler\['_last_lr'\]\[0\] = nan"),
    ("optim", lambda sd: sd["param_groups"][0].__setitem__("lr", __import__("torch").tensor(1e-3)),
     r"optim_world_size_6_rank_0\.pt: param_groups\[0\]\['lr'\] is a Tensor"),
])
def test_values_json_cannot_hold_are_named_when_converting_to_orbax(actor, tmp_path, kind, change,
                                                                     message):
    """On every rank (rank 0's alone is a rank that differs): `--to orbax` copies param_groups
    and the scheduler state into training_metadata.json."""
    from convert.orbax_directions import verl_to_orbax

    _edit_every_rank(actor, kind, change)
    with pytest.raises(ConvertError, match=message):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_shard_of_another_dtype_or_an_integer_weight_is_refused(actor, tmp_path):
    import torch

    name = "model.layers.0.self_attn.q_proj.weight"

    def to(dtype):
        def change(sd):
            t = sd[name]
            sd[name] = type(t).from_local(t._local_tensor.to(dtype), t.device_mesh, t.placements,
                                          shape=t.shape, stride=t.stride())
        return change

    _edit(actor / "model_world_size_6_rank_1.pt", to(torch.bfloat16))
    with pytest.raises(ConvertError, match=rf"rank_1\.pt: {name} has dtype torch\.bfloat16 on "
                                           r"this rank but torch\.float32 on rank 0"):
        verl_to_hf(actor, tmp_path / "out")
    _edit_every_rank(actor, "model", to(torch.int32))
    with pytest.raises(ConvertError, match=rf"rank_0\.pt: {name} has dtype torch\.int32; weights"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_tensors_in_optimizer_settings_convert_where_no_json_holds_them(actor, tmp_path):
    """A 0-d tensor lr (torch >= 2.2 accepts one) and a 2-element tensor in the scheduler
    state: `--to hf` (reads neither) and `--to verl` (carries them by pickle) convert; a
    scheduler state differing between ranks is named. The JSON check refused both directions
    for a while, and comparing the ranks' scheduler states with `!=` raised RuntimeError."""
    import torch

    def tensors(sd):
        sd["lr_scheduler"]["base_lrs"] = [torch.tensor([1e-3, 2e-3])]

    _edit_every_rank(actor, "optim", lambda sd: sd["param_groups"][0].__setitem__(
        "lr", torch.tensor(1e-3)))
    _edit_every_rank(actor, "extra_state", tensors)
    verl_to_hf(actor, tmp_path / "hf")
    verl_to_verl(actor, tmp_path / "verl", world_size=2)
    [written] = (tmp_path / "verl").rglob("extra_state_world_size_2_rank_1.pt")
    back = load_pt(written, mmap=False)
    assert torch.equal(back["lr_scheduler"]["base_lrs"][0], torch.tensor([1e-3, 2e-3]))
    _edit(actor / "extra_state_world_size_6_rank_4.pt",
          lambda sd: sd["lr_scheduler"].__setitem__("base_lrs", [torch.tensor([1e-3, 3e-3])]))
    with pytest.raises(ConvertError, match=r"extra_state_world_size_6_rank_4\.pt: lr_scheduler "
                                           r"differs from rank 0's"):
        verl_to_verl(actor, tmp_path / "verl2", world_size=2)


@pytest.mark.parametrize("placements,message", [
    ("Shard(5)", r"placement Shard\(5\) is outside its 2 dimensions"),
    ("()", r"has 0 placements on a mesh of 1 dims"),
])
def test_a_placement_outside_the_tensor_or_the_mesh_is_named(actor, tmp_path, placements, message):
    """A DTensor saved with Shard(5) of a 2-D weight, or with no placement (torch loads both
    under weights_only=True): an IndexError traceback in every direction and --inspect."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    name = "model.layers.0.self_attn.q_proj.weight"
    chosen = (Shard(5),) if placements == "Shard(5)" else ()

    def change(sd):
        t = sd[name]
        spec = DTensorSpec(t.device_mesh, chosen, TensorMeta(t.shape, t.stride(), t.dtype))
        sd[name] = torch.distributed.tensor.DTensor(t._local_tensor, spec, requires_grad=False)

    _edit_every_rank(actor, "model", change)
    for convert in (verl_to_hf, lambda a, out: verl_to_verl(a, out, world_size=2)):
        with pytest.raises(ConvertError, match=rf"model_world_size_6_rank_0\.pt: {name} {message}"):
            convert(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_run_whose_latest_step_loops_back_or_overflows_is_named(actor, tmp_path):
    """latest_checkpointed_iteration.txt naming `global_step_1 -> .` recursed 40 levels to the
    OS's symbolic link limit and printed a path 80 steps long; a step over int32 was converted
    into a directory no resume could read."""
    run = actor.parent.parent
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    os.symlink(".", run / "global_step_1")
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(run))}/latest_checkpointed_iteration"
                                           rf"\.txt: names step 1 but {re.escape(str(run))}/"
                                           r"global_step_1 holds no VERL rank files"):
        verl_to_hf(run, tmp_path / "out")
    (run / "latest_checkpointed_iteration.txt").write_text(str(2 ** 31))
    with pytest.raises(ConvertError, match=r"expected a step number in 0\.\.2147483647, got "
                                           r"'2147483648'"):
        verl_to_hf(run, tmp_path / "out")
    big = run / f"global_step_{2 ** 31}"
    os.rename(actor.parent, big)
    with pytest.raises(ConvertError, match=r"global_step_2147483648: global step 2147483648 is "
                                           r"over 2147483647"):
        verl_to_hf(big / "actor", tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_an_expanded_shard_is_refused_before_it_is_read(actor, tmp_path):
    """A local shard or plain tensor saved as `zeros(1).expand(rows, cols)` (stride 0, 4 bytes
    of storage) is refused naming file and key: reading it would make rows x cols x W values
    of a few bytes (terabytes from a small file)."""
    import torch

    name = "model.layers.0.self_attn.q_proj.weight"

    def expanded(sd):
        t = sd[name]
        local = torch.zeros(1).expand(*t._local_tensor.shape)
        sd[name] = type(t).from_local(local, t.device_mesh, t.placements, shape=t.shape,
                                      stride=t.stride(), run_check=False)

    _edit(actor / "model_world_size_6_rank_2.pt", expanded)
    with pytest.raises(ConvertError, match=rf"rank_2\.pt: {re.escape(name)} is not contiguous "
                                           r"\(strides \(0, 0\) for shape"):
        verl_to_hf(actor, tmp_path / "out")

    def plain(sd):
        sd[name] = torch.zeros(1).expand(*sd[name].shape)

    _edit_every_rank(actor, "model", plain)
    with pytest.raises(ConvertError, match=rf"rank_0\.pt: {re.escape(name)} is not contiguous"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_tied_head_that_differs_from_the_embedding_is_refused(actor, tmp_path, capsys):
    from jscenegen.cli import main

    def change(sd):  # a head of its own (FSDP2 saves a tied head as the embedding's storage)
        t = sd["lm_head.weight"]
        sd["lm_head.weight"] = type(t).from_local(t._local_tensor + 1.0, t.device_mesh, t.placements,
                                                  shape=t.shape, stride=t.stride())

    _edit_every_rank(actor, "model", change)
    with pytest.raises(ConvertError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)
    # refused when the checkpoint opens: the orbax write never starts (one line, no thread logs)
    assert main(["convert", str(actor), str(tmp_path / "out"), "--from", "verl", "--to", "orbax"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lm_head.weight differs" in err, err
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("change,message", [
    (lambda h, q: h[q].__setitem__("data_offsets", [0, h[q]["data_offsets"][1] - h[q]["data_offsets"][0]]),
     r"tensors .* share bytes"),
    (lambda h, q: h[q].pop("data_offsets"), r"tensor '.*q_proj.weight': an entry holds exactly"),
    (lambda h, q: h[q].__setitem__("data_offsets", [-4, 0]), r"q_proj.weight': data_offsets must be"),
    (lambda h, q: h[q].__setitem__("data_offsets", [1.5, 2]), r"q_proj.weight': data_offsets must be"),
    (lambda h, q: h[q].__setitem__("dtype", "F7"), r"has dtype F7; supported"),
    # a span of other length than shape x dtype: read, a tensor took another's bytes
    (lambda h, q: h[q].__setitem__("shape", [h[q]["shape"][0] - 1, h[q]["shape"][1]]),
     r"tensor '.*q_proj.weight' spans \d+ bytes; F32\[\d+, \d+\] needs \d+"),
    # what the safetensors library refuses too (and raw Python errors naming no tensor)
    (lambda h, q: h[q].__setitem__("shape", ["a", 2]), r"q_proj.weight': dtype must be a string and shape"),
    (lambda h, q: h[q].__setitem__("extra", 1), r"q_proj.weight': an entry holds exactly"),
    (lambda h, q: h.__setitem__("__metadata__", {"format": 1}), r"__metadata__ must map strings"),
    (lambda h, q: h.__setitem__("__metadata__", ["pt"]), r"__metadata__ must map strings"),
    # an empty tensor inside another's bytes: the safetensors library's invalid offset
    (lambda h, q: h.__setitem__("empty", {"dtype": "F32", "shape": [0], "data_offsets": [
        h[q]["data_offsets"][0] + 4] * 2}), r"tensor 'empty' starts at \d+, inside the bytes of "
                                            r"another tensor"),
])
def test_a_malformed_safetensors_header_is_refused_naming_file_and_tensor(tiny_hf, tmp_path, change,
                                                                         message):
    import struct

    from convert.dispatch import convert

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    f = src / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    q = "model.layers.0.self_attn.q_proj.weight"
    change(header, q)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    for fmt in ("verl", "orbax"):
        with pytest.raises(ValueError, match=rf"model\.safetensors: .*{message}"):
            convert(src, tmp_path / "out", src_format="hf", dst_format=fmt,
                    world_size=2 if fmt == "verl" else None)
        _assert_nothing_written(tmp_path)
    from jscenegen.model.hf_io import load_hf

    with pytest.raises(ValueError, match=rf"model\.safetensors: .*{message}"):   # the same rules
        load_hf(src)


@pytest.mark.parametrize("option, flag", [({"world_size": 2}, "--world-size"),
                                          ({"placement": "first-divisible"}, "--placement"),
                                          ({"mesh_device": "cpu"}, "--mesh-device")])
def test_verl_output_options_are_refused_for_an_output_without_ranks(actor, tmp_path, option, flag):
    """--placement and --mesh-device were ignored silently for --to hf/orbax."""
    from convert.dispatch import convert

    with pytest.raises(ConvertError, match=rf"^{flag} shapes the rank files of a VERL output; --to hf"):
        convert(actor, tmp_path / "out", src_format="verl", dst_format="hf", **option)


def test_a_non_finite_optimizer_setting_is_named_by_its_key(actor, tmp_path):
    """lr NaN in torch's param_groups: the refusal said 'Out of range float values are not
    JSON compliant', naming neither the file's field nor the key; then the metadata's key, not
    the rank file."""
    from convert.orbax_directions import verl_to_orbax

    _edit_every_rank(actor, "optim", lambda sd: sd["param_groups"][0].__setitem__("lr", float("nan")))
    with pytest.raises(ConvertError, match=r"optim_world_size_6_rank_0\.pt: param_groups\[0\]\['lr'\] "
                                           r"= nan"):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    """json.loads keeps the last of two equal keys: the first tensor's bytes were unread."""
    import struct

    from jscenegen.model.safetensors_stream import read_header

    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw = f'{{"w": {entry}, "w": {entry}}}'.encode()
    raw += b" " * (-len(raw) % 8)
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(ValueError, match=r"model\.safetensors: .*the key 'w' appears twice in one object"):
        read_header(f)


def test_per_rank_copies_that_disagree_are_refused(actor, tmp_path):
    """Rank 1's scheduler, or a Replicate() DTensor's copy on rank 1, differing from rank 0's
    (both were taken from rank 0 unseen)."""
    import torch
    from torch.distributed.tensor import Replicate

    from convert.orbax_directions import verl_to_orbax

    _edit(actor / "extra_state_world_size_6_rank_1.pt",
          lambda sd: sd["lr_scheduler"].__setitem__("last_epoch", 99))
    with pytest.raises(ConvertError, match=r"extra_state_world_size_6_rank_1\.pt: lr_scheduler "
                                           r"differs from rank 0's"):
        verl_to_orbax(actor, tmp_path / "out")
    name = "model.norm.weight"
    full = torch.cat([load_pt(actor / f"model_world_size_6_rank_{r}.pt", mmap=False)[name]._local_tensor
                      for r in range(6)])

    def replicated(r):
        def change(sd):
            t = sd[name]
            sd[name] = type(t).from_local(full + (r == 4), t.device_mesh, [Replicate()],
                                          shape=t.shape, stride=t.stride())
        return change

    for r in range(6):
        _edit(actor / f"model_world_size_6_rank_{r}.pt", replicated(r))
    with pytest.raises(ConvertError, match=rf"model_world_size_6_rank_4\.pt: replicated {name} "
                                           r"differs from rank 0's copy"):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_replicated_copies_are_compared_bit_for_bit(actor, tmp_path):
    """Replicas compared by value read a NaN every rank holds as a copy that differs, and let
    -0.0 on one rank pass as 0.0."""
    import torch
    from safetensors.numpy import load_file
    from torch.distributed.tensor import Replicate

    name = "model.norm.weight"
    full = torch.cat([load_pt(actor / f"model_world_size_6_rank_{r}.pt", mmap=False)[name]._local_tensor
                      for r in range(6)])

    def replicate_with_first(value_on_rank):
        for r in range(6):
            def change(sd):
                t, copy = sd[name], full.clone()
                copy[0] = value_on_rank(r)
                sd[name] = type(t).from_local(copy, t.device_mesh, [Replicate()], run_check=False,
                                              shape=t.shape, stride=t.stride())
            _edit(actor / f"model_world_size_6_rank_{r}.pt", change)

    replicate_with_first(lambda r: float("nan"))
    verl_to_hf(actor, tmp_path / "out")
    carried = load_file(next((tmp_path / "out").glob("*.safetensors")))[name]
    assert np.isnan(carried[0]) and np.array_equal(carried[1:], full[1:].numpy())
    for r in range(6):   # the same bytes in another dtype and shape: not the same tensor
        def as_half(sd, r=r):
            t = sd[name]
            local = full.view(torch.float16) if r == 3 else full
            sd[name] = type(t).from_local(local, t.device_mesh, [Replicate()], run_check=False,
                                          shape=t.shape, stride=t.stride())
        _edit(actor / f"model_world_size_6_rank_{r}.pt", as_half)
    with pytest.raises(ConvertError, match=rf"rank_3\.pt: replicated {name} is float16 \(\d+,\) "
                                           r"where rank 0's copy is float32 \(\d+,\)$"):
        verl_to_hf(actor, tmp_path / "out3")
    replicate_with_first(lambda r: -0.0 if r == 2 else 0.0)
    with pytest.raises(ConvertError, match=rf"model_world_size_6_rank_2\.pt: replicated {name} "
                                           r"differs from rank 0's copy"):
        verl_to_hf(actor, tmp_path / "out2")
    _assert_nothing_written(tmp_path, "out2")


def test_half_precision_moments_widen_and_float64_shards_are_named(actor, tmp_path):
    import torch

    from convert.orbax_directions import verl_to_orbax
    from convert.verl_read import VerlCheckpoint

    want = VerlCheckpoint(actor).read_moment("model.norm.weight", "exp_avg")

    def to_bf16(sd):
        for st in sd["state"].values():
            for m in ("exp_avg", "exp_avg_sq"):
                t = st[m]
                st[m] = type(t).from_local(t._local_tensor.to(torch.bfloat16), t.device_mesh,
                                           t.placements, shape=t.shape, stride=t.stride())

    _edit_every_rank(actor, "optim", to_bf16)
    got = VerlCheckpoint(actor).read_moment("model.norm.weight", "exp_avg")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))
    verl_to_orbax(actor, tmp_path / "orbax")        # moments declared float32 are float32
    name = "model.layers.0.self_attn.q_proj.weight"

    def to_f64(sd):
        t = sd[name]
        sd[name] = type(t).from_local(t._local_tensor.double(), t.device_mesh, t.placements,
                                      shape=t.shape, stride=t.stride())

    _edit_every_rank(actor, "model", to_f64)
    with pytest.raises(ConvertError, match=rf"model_world_size_6_rank_0\.pt: {name} has dtype "
                                           r"torch\.float64; weights and AdamW moments are float32, "
                                           r"bfloat16, float16"):
        verl_to_hf(actor, tmp_path / "out")


def test_the_global_step_falls_back_to_the_adam_step(actor):
    """Outside a global_step_N directory and without scheduler state, the step is AdamW's
    (it was 0); a step file holding a non-ASCII digit is named."""
    from convert.verl_read import VerlCheckpoint, find_verl

    flat = actor.parent.parent / "flat"
    shutil.copytree(actor, flat)
    _edit_every_rank(flat, "extra_state", lambda sd: sd.__setitem__("lr_scheduler", None))
    ck = VerlCheckpoint(flat)
    assert ck.layout.global_step is None and ck.scheduler_step() is None
    assert ck.global_step() == ck.adam_step() == 3
    run = actor.parent.parent
    (run / "latest_checkpointed_iteration.txt").write_text("\u00b3")
    with pytest.raises(ConvertError, match=r"latest_checkpointed_iteration\.txt: expected a step "
                                           r"number in 0\.\.2147483647, got '\u00b3'"):
        find_verl(run)


def test_an_fsdp1_sharded_state_dict_is_named(tmp_path):
    """FSDP1's SHARDED_STATE_DICT pickles torch ShardedTensors, which weights_only refuses; the
    error said to allowlist them."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    class Pickles:       # a stand-in that pickles as a ShardedTensor reference
        def __reduce__(self):
            return (ShardedTensor, ())

    f = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"model.norm.weight": Pickles()}, f)
    with pytest.raises(ConvertError, match=r"rank_0\.pt: holds torch ShardedTensors: an FSDP1 "
                                           r"SHARDED_STATE_DICT checkpoint"):
        load_pt(f)


def test_the_crc_check_anchors_past_a_device_mesh_record(tmp_path):
    """Rank 40 of 64 holds an empty shard of the first tensor, so its first non-empty zip
    record is the DeviceMesh's `_rank_map` (no reachable tensor): the check anchored the
    lowest storage there and switched itself off for ranks 32-63 of an `export --world-size
    64`, with a warning, and a flipped bit converted silently."""
    import warnings

    import numpy as np
    import torch

    from convert.torch_safe import StorageCrcs
    from convert.verl_write import _dtensor, _fake_rank

    f = tmp_path / "model_world_size_64_rank_40.pt"
    with _fake_rank(40, 64, "cpu") as mesh:
        torch.save({"first": _dtensor(np.zeros((0, 4), np.float32), mesh, 0, (32, 4), "cpu"),
                    "second": _dtensor(np.ones((2, 64), np.float32), mesh, 0, (128, 64), "cpu")}, f)
    _flip_tensor_byte(f)
    sd = load_pt(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "do not lie at its zip records' offsets"
        crcs = StorageCrcs(f, sd)
    with pytest.raises(ConvertError, match=r"rank_40\.pt: second: its bytes fail the CRC-32"):
        crcs.check(sd["second"]._local_tensor.untyped_storage(), "second")


def test_the_crc_check_anchors_past_empty_storages_and_names_a_corrupt_replica(tmp_path, actor):
    """An empty tensor first in a file switched the check off for the whole file; a flipped
    bit in rank 0's copy of a replicated tensor blamed rank 1's file for differing."""
    import torch

    from convert.torch_safe import StorageCrcs

    f = tmp_path / "two.pt"
    torch.save({"a": torch.empty(0), "b": torch.randn(64, 64)}, f)
    _flip_tensor_byte(f)
    obj = load_pt(f)
    with pytest.raises(ConvertError, match=r"two\.pt: b: its bytes fail the CRC-32"):
        StorageCrcs(f, obj).check(obj["b"].untyped_storage(), "b")
    name = "model.norm.weight"
    full = torch.cat([load_pt(actor / f"model_world_size_6_rank_{r}.pt", mmap=False)[name]._local_tensor
                      for r in range(6)])
    _edit_every_rank(actor, "model", lambda sd: sd.__setitem__(name, full.clone()))
    rank0 = actor / "model_world_size_6_rank_0.pt"
    sd = load_pt(rank0)
    crcs = StorageCrcs(rank0, sd)
    record = crcs.records[sd[name].untyped_storage().data_ptr() - crcs.base][2]
    del sd, crcs
    _flip_tensor_byte(rank0, record)
    with pytest.raises(ConvertError, match=rf"model_world_size_6_rank_0\.pt: {name}: its bytes fail"):
        verl_to_hf(actor, tmp_path / "out")


@pytest.mark.parametrize("change,message", [
    (lambda cfg: cfg.pop("world_size"), r"no world_size key \(the rank files say 6\)"),
    (lambda cfg: cfg.update(world_size=True), r"world_size must be an integer, got true"),
    (lambda cfg: cfg.update(world_size=6.0), r"world_size must be an integer, got 6\.0"),
])
def test_an_fsdp_config_world_size_that_is_absent_or_no_integer_says_so(actor, tmp_path, change,
                                                                       message):
    """These read as "world_size None (True, 6.0) contradicts the rank files"."""
    f = actor / "fsdp_config.json"
    cfg = json.loads(f.read_text())
    change(cfg)
    f.write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(f))}: {message}$"):
        verl_to_hf(actor, tmp_path / "out")


@pytest.mark.parametrize("make,state", [
    (lambda hf: hf.write_text("not a directory"), "is a file, not a directory"),
    (lambda hf: hf.symlink_to("nowhere"), "is a broken symbolic link, not a directory"),
    (lambda hf: None, "missing"),
    (lambda hf: hf.mkdir(), "no config.json"),
])
def test_a_huggingface_entry_that_holds_no_config_is_named_for_what_it_is(actor, tmp_path, make,
                                                                          state):
    """A file or a dangling link there read as "no config.json"."""
    hf = actor / "huggingface"
    shutil.rmtree(hf)
    make(hf)
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(hf))}: {state}; VERL's checkpoint"):
        verl_to_hf(actor, tmp_path / "out")


def test_a_verl_source_without_a_tokenizer_converts_to_hf_with_a_warning(actor, tmp_path):
    from convert.errors import ConversionWarning

    (actor / "huggingface/tokenizer.json").unlink()
    (actor / "huggingface/tokenizer_config.json").unlink()
    with pytest.warns(ConversionWarning, match=r"huggingface: no tokenizer \(tokenizer\.json"):
        verl_to_hf(actor, tmp_path / "out")
    assert (tmp_path / "out/config.json").is_file()


def test_an_hf_tied_head_that_differs_from_the_embedding_is_refused(tiny_hf, tmp_path):
    """`convert HF --to verl/orbax` of a tied model whose stored lm_head.weight differs from the
    embedding wrote it tied, dropping that head (exit 0); `load_hf` refuses the directory."""
    from safetensors.numpy import load_file, save_file

    from convert.dispatch import convert

    for differs in (True, False):
        src = tmp_path / f"hf-{differs}"
        shutil.copytree(tiny_hf["qwen3"], src)
        tensors = load_file(src / "model.safetensors")
        head = tensors["model.embed_tokens.weight"].copy()
        head[-1, -1] += 1.0 if differs else 0.0
        save_file({**tensors, "lm_head.weight": head}, src / "model.safetensors")
        for fmt in ("verl", "orbax"):
            out = tmp_path / f"out-{differs}-{fmt}"
            kwargs = dict(src_format="hf", dst_format=fmt, world_size=2 if fmt == "verl" else None)
            if differs:
                with pytest.raises(ConvertError, match=r"model\.safetensors: lm_head\.weight differs "
                                                       r"from model\.embed_tokens\.weight but the "
                                                       r"config ties them"):
                    convert(src, out, **kwargs)
                _assert_nothing_written(tmp_path, out.name)
            elif fmt == "verl":   # the same values: the alias transformers may save, written tied
                convert(src, out, **kwargs)     # (the fixture has no tokenizer orbax could carry)


@pytest.mark.parametrize("damage,message", [
    ("trailing", r"64 bytes after the last tensor belong to none"),
    ("hole", r"64 bytes before tensor '.*' belong to no tensor"),
])
def test_safetensors_bytes_that_belong_to_no_tensor_are_refused(tiny_hf, tmp_path, capsys, damage,
                                                                 message):
    """Bytes after the last tensor, or a hole between two, made the safetensors library (and so
    `convert --inspect`, and transformers) fail with a traceback while `convert` accepted them."""
    import struct

    from convert.dispatch import convert
    from jscenegen.cli import main

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf["qwen3"], src)
    f = src / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "trailing":
        f.write_bytes(data + b"\0" * 64)
    else:   # every tensor after the first moves 64 bytes on
        header = json.loads(data[8:8 + n])
        first = min((e["data_offsets"][0], k) for k, e in header.items() if k != "__metadata__")[1]
        for k, e in header.items():
            if k not in ("__metadata__", first):
                e["data_offsets"] = [o + 64 for o in e["data_offsets"]]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        body, cut = data[8 + n:], header[first]["data_offsets"][1]
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + body[:cut] + b"\0" * 64 + body[cut:])
    with pytest.raises(ValueError, match=rf"model\.safetensors: unreadable safetensors file \({message}"):
        convert(src, tmp_path / "out", src_format="hf", dst_format="verl", world_size=2)
    _assert_nothing_written(tmp_path)
    assert main(["convert", "--inspect", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


def _set_first_local(moment: str, value: float):
    """Set the first element of rank's first non-empty local `moment` shard to `value`."""
    def change(sd):
        for st in sd["state"].values():
            local = st[moment]._local_tensor.view(-1)
            if local.numel():
                local[0] = value
                return
        raise AssertionError("no non-empty local shard")
    return change


def _set_step(sd):
    import torch

    sd["state"][0]["step"] = torch.tensor(4.0)


@pytest.mark.parametrize("change,message", [
    # another rank's settings were dropped: only rank 0's param_groups were kept
    (lambda sd: sd["param_groups"][0].__setitem__("lr", 0.5),
     r"rank_2\.pt: param_groups\[0\]\.lr \(0\.5 vs [0-9.e-]+\) differs from rank 0's"),
    # carried as they were: the first update in JAX made NaN of the parameter
    (_set_first_local("exp_avg_sq", -1.0),
     r"rank_2\.pt: state\[\d+\]\.exp_avg_sq \(\S+\) holds a negative value \(-1\.0\); a mean of squares"),
    (_set_first_local("exp_avg", float("nan")),
     r"rank_2\.pt: state\[\d+\]\.exp_avg \(\S+\) holds a non-finite value \(nan\)"),
    # was "actor: optimizer step differs across ranks/params: [3.0, 4.0]", naming no file
    (_set_step, r"rank_2\.pt: state\[0\]\.step \(\S+\) is 4, rank 0's state\[0\] 3; every parameter")])
def test_optimizer_state_that_differs_between_ranks_or_cannot_be_adams_is_named(actor, tmp_path, change, message):
    from convert.orbax_directions import verl_to_orbax

    _edit(actor / "optim_world_size_6_rank_2.pt", change)
    with pytest.raises(ConvertError, match=message):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_non_finite_replicated_moment_is_named_as_such(actor, tmp_path):
    """A NaN differs from itself: a replicated moment holding one was reported as a copy that
    differs from rank 0's."""
    import torch
    from torch.distributed.tensor import Replicate

    from convert.orbax_directions import verl_to_orbax

    def replicate_with_nan(sd):
        t = sd["state"][0]["exp_avg"]
        full = torch.zeros(t.shape, dtype=t.dtype)
        full.view(-1)[0] = float("nan")
        sd["state"][0]["exp_avg"] = type(t).from_local(full, t.device_mesh, [Replicate()], run_check=False,
                                                       shape=t.shape, stride=full.stride())

    _edit_every_rank(actor, "optim", replicate_with_nan)
    with pytest.raises(ConvertError, match=r"rank_0\.pt: state\[0\]\.exp_avg \(\S+\) holds a non-finite value \(nan\)$"):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_defaulted_linear_attention_size_is_named_in_the_shape_error(qwen35_hf, tmp_path):
    """A Qwen3.5 config.json without text_config.linear_num_value_heads takes transformers'
    default (32); the shape error named only the tensor, not the field that caused it."""
    from convert.directions import hf_to_verl
    from jscenegen.model.hf_io import load_hf
    from jscenegen.model.weights import CheckpointFormatError

    src = tmp_path / "hf"
    shutil.copytree(qwen35_hf["qwen3_5"], src)
    doc = json.loads((src / "config.json").read_text())
    del doc["text_config"]["linear_num_value_heads"]
    (src / "config.json").write_text(json.dumps(doc))
    why = (r"dt_bias.* has shape \(4,\), .*\(32,\); text_config\.linear_num_value_heads is absent, "
           r"so transformers' default 32 was assumed")
    with pytest.raises(ConvertError, match=why):
        hf_to_verl(src, tmp_path / "out", world_size=2)
    _assert_nothing_written(tmp_path)
    with pytest.raises(CheckpointFormatError, match=why):
        load_hf(src)


def test_weights_holding_nan_are_converted_with_a_warning_naming_them(tmp_path):
    """A NaN in the weights passed every conversion silently (loading warned, convert did not)."""
    from safetensors.numpy import load_file, save_file

    from convert.dispatch import convert
    from convert.errors import ConversionWarning

    from chat_fixtures import chat_model_dir

    src = tmp_path / "hf"
    shutil.copytree(chat_model_dir(), src)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][0, 0] = np.nan
    save_file(tensors, str(src / "model.safetensors"))
    why = rf"1 tensor\(s\) hold NaN or Inf values: {re.escape(name)} \(copied as they are"
    with pytest.warns(ConversionWarning, match=why):
        convert(src, tmp_path / "verl", src_format="hf", dst_format="verl", world_size=2)
    with pytest.warns(ConversionWarning, match=why):
        convert(tmp_path / "verl", tmp_path / "back", src_format="verl", dst_format="hf")
    with pytest.warns(ConversionWarning, match=why):
        convert(tmp_path / "verl", tmp_path / "run" / "checkpoints", src_format="verl",
                dst_format="orbax")
    step = next(p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    with pytest.warns(ConversionWarning, match=why):
        convert(step, tmp_path / "from_orbax", src_format="orbax", dst_format="hf")
    from convert.export import export

    with pytest.warns(ConversionWarning, match=why):
        export(step, tmp_path / "published", world_size=2, device_type="cpu")
    assert np.isnan(load_file(str(tmp_path / "back" / "model.safetensors"))[name][0, 0])


@pytest.mark.parametrize("step,dtype", [(0.0, "float32"), (2.0 ** 31 - 1, "float64")])
def test_the_adam_step_range_includes_both_ends_of_the_stores_int32_count(actor, step, dtype):
    """0 (state created, no step taken yet) and 2**31 - 1 are AdamW counts an orbax store
    holds: both read, as integers (torch keeps `step` in float64 when that is its default
    dtype; float32 cannot hold 2**31 - 1)."""
    import torch

    from convert.verl_read import VerlCheckpoint

    def set_steps(sd):
        for st in sd["state"].values():
            st["step"] = torch.tensor(step, dtype=getattr(torch, dtype))

    _edit_every_rank(actor, "optim", set_steps)
    assert VerlCheckpoint(actor).adam_step() == int(step)


@pytest.mark.parametrize("step", [2.0 ** 31, 2.0 ** 40])
def test_an_adam_step_beyond_the_stores_int32_count_is_refused_naming_the_file(actor, tmp_path, step):
    """Every parameter at AdamW step 2**31: the orbax store's int32 count raised OverflowError
    (a traceback) instead of naming the file."""
    import torch

    def set_steps(sd):
        for st in sd["state"].values():
            st["step"] = torch.tensor(step)

    _edit_every_rank(actor, "optim", set_steps)
    from convert.orbax_directions import verl_to_orbax

    with pytest.raises(ConvertError, match=rf"^{re.escape(str(actor / 'optim_world_size_6_rank_0.pt'))}"
                                           rf": step {int(step)} is outside 0\.\.2147483647 \(an "
                                           r"orbax checkpoint stores AdamW's count as int32\)$"):
        verl_to_orbax(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("stray", ["model_world_size_6_rank_01.pt", "optim_world_size_06_rank_2.pt"])
def test_a_rank_file_name_with_a_leading_zero_is_refused_naming_it(actor, tmp_path, stray):
    """`..._rank_01.pt` beside `..._rank_1.pt` counted as rank 1 (int("01") == 1): one of the two
    was read and the other ignored without a word, whichever the reader met."""
    from convert.verl_read import find_verl

    kind = stray.partition("_world_size_")[0]
    shutil.copy(actor / f"{kind}_world_size_6_rank_1.pt", actor / stray)
    with pytest.raises(ConvertError) as err:
        find_verl(actor)
    want = (f"{actor / stray}: not a rank file name VERL writes (world size and rank are plain "
            f"decimals without leading zeros: {kind}_world_size_6_rank_{1 if 'rank_01' in stray else 2}"
            ".pt); remove or rename it, it would count as that rank")
    assert str(err.value) == want
    with pytest.raises(ConvertError, match=re.escape(stray)):
        verl_to_hf(actor, tmp_path / "out")
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("key,value,shown", [("lr", 0.5, "0.5"), ("weight_decay", 0.0, "0.0"),
                                             ("betas", (0.9, 0.95), r"\(0\.9, 0\.95\)")])
def test_optimizer_groups_with_their_own_settings_are_refused_naming_the_key(actor, tmp_path, key,
                                                                           value, shown):
    """Two param_groups (the norms without weight decay, say) were flattened into one: the
    second group's lr / weight_decay / betas were lost, group 0's written for every parameter."""
    from convert.orbax_directions import verl_to_orbax

    def split(sd):
        (group,) = sd["param_groups"]
        half = len(group["params"]) // 2
        sd["param_groups"] = [dict(group, params=group["params"][:half]),
                              dict(group, params=group["params"][half:], **{key: value})]

    _edit_every_rank(actor, "optim", split)
    for convert_to in (verl_to_orbax, lambda s, d: verl_to_verl(s, d, world_size=3)):
        with pytest.raises(ConvertError, match=(
                rf"^{re.escape(str(actor / 'optim_world_size_6_rank_0.pt'))}: param_groups\[1\]\."
                rf"{key} \({shown} vs param_groups\[0\]'s [^;]+\); jscenegen trains every parameter "
                r"with one AdamW setting, so groups that differ in anything but their params "
                r"cannot be converted \(--to hf takes the weights alone\)$")):
            convert_to(actor, tmp_path / "out")
        _assert_nothing_written(tmp_path)
    # the weights alone convert, and --inspect describes the files, naming the groups that differ
    from convert.inspect import describe

    verl_to_hf(actor, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    described = describe(actor)
    assert described["optimizer_groups_differ"].startswith(f"param_groups[1].{key} (")


_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None          # as on a machine without the .[torch] extra
from jscenegen.cli import main
src, out = sys.argv[1], sys.argv[2]
print(json.dumps([main(["convert", src, out + "/orbax", "--from", "hf", "--to", "orbax"]),
                  main(["convert", out + "/orbax", out + "/hf", "--from", "orbax", "--to", "hf"]),
                  main(["convert", src, out + "/verl", "--from", "hf", "--to", "verl",
                        "--world-size", "2"]),
                  main(["export", out + "/orbax", out + "/export"])]))
"""


def test_hf_and_orbax_directions_need_no_torch_and_verl_ones_say_how_to_install_it(tmp_path):
    """`convert --to orbax` (and every direction) ended in a ModuleNotFoundError traceback
    without torch: the layout file imported it only to record its version. HF and orbax
    directions run without it; VERL ones and export are refused in one line naming the extra."""
    import subprocess
    import sys

    from chat_fixtures import chat_model_dir

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(chat_model_dir()), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.splitlines()[-1] == "[0, 0, 2, 2]", proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    needs = "reads or writes VERL's rank files (torch pickles) and needs torch, which is not " \
            "installed: pip install -e '.[torch]' (torch==2.13.0)"
    assert errors == [f"error: convert hf -> verl {needs}", f"error: export {needs}"]
    assert "Traceback" not in proc.stderr
    layout = json.loads((tmp_path / "orbax" / "checkpoint-layout.json").read_text())
    assert layout["torch_version"] == importlib.metadata.version("torch")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not (tmp_path / "verl").exists() and not (tmp_path / "export").exists()
