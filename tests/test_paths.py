"""The atomic writers of jscenegen/paths.py: permissions, replacement, failure."""
import os

import pytest

from jscenegen.paths import atomic_dir, write_json


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_staged_output_has_the_permissions_of_a_plain_mkdir(tmp_path):
    with atomic_dir(tmp_path / "out") as d:
        (d / "f").write_text("x")
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~_umask()


def test_atomic_dir_refuses_a_non_empty_destination_before_writing(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("old")
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_dir(tmp_path / "out"):
            raise AssertionError("the body must not run")
    assert (tmp_path / "out" / "keep").read_text() == "old"


def test_atomic_dir_replace_swaps_only_a_complete_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(out, replace=True) as d:
            (d / "new").write_text("half")
            raise RuntimeError("failed while writing")
    assert sorted(p.name for p in out.iterdir()) == ["keep"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind
    with atomic_dir(out, replace=True) as d:
        (d / "new").write_text("whole")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_write_json_has_umask_permissions_and_sorted_keys(tmp_path):
    write_json(tmp_path / "a.json", {"b": 1, "a": 2})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
