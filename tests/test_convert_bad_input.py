"""Refusals: missing rank files, contradicting world sizes, truncated files, hostile pickles.

Each must raise ConvertError naming the file, and leave nothing at the destination (the
output is staged in a temp directory and only renamed into place when complete).
"""
from __future__ import annotations

import json
import os
import shutil

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


def test_truncated_file(actor, tmp_path):
    f = actor / "model_world_size_6_rank_2.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match=r"model_world_size_6_rank_2\.pt: refused"):
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
        assert main(["convert", str(actor), str(out), "--from", "verl", "--to", to,
                     "--world-size", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"{kind}_world_size_6_rank_2.pt: holds the shard" in err, err
        _assert_nothing_written(tmp_path, out.name)


def _flip_tensor_byte(f):
    """Flip one bit in the middle of the largest tensor storage of torch file `f` (a zip)."""
    import struct
    import zipfile

    with zipfile.ZipFile(f) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(f.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x01
    f.write_bytes(bytes(data))


def test_a_source_that_fails_its_checksums_is_refused_before_converting(actor, tmp_path_factory):
    from convert.dispatch import convert
    from jscenegen.checkpoint.checksums import write_checksums

    root = actor.parent.parent  # global_step_3/actor/... listed by a checksums.json two levels up
    write_checksums(root)
    out = tmp_path_factory.mktemp("dst")   # outside the checksummed tree (refused inside it)
    f = actor / "optim_world_size_6_rank_2.pt"
    _flip_tensor_byte(f)  # the file still loads: only the checksums can tell
    with pytest.raises(ConvertError, match=r"does not match .*checksums\.json.*"
                                           r"global_step_3/actor/optim_world_size_6_rank_2\.pt: SHA-256 differs"):
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


def test_hf_to_orbax_names_the_source_without_a_tokenizer(tmp_path):
    from convert.orbax_directions import hf_to_orbax

    from hf_fixtures import make_hf_dir

    src = make_hf_dir(tmp_path / "hf", "qwen3")
    assert not (src / "tokenizer.json").exists()
    with pytest.raises(ConvertError, match=rf"^{src}: no tokenizer") as err:
        hf_to_orbax(src, tmp_path / "out")
    assert "jscenegen-hf-assets" not in str(err.value)
    _assert_nothing_written(tmp_path)
