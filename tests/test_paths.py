"""jscenegen/paths.py: the atomic writers (permissions, replacement, failure) and the JSON-object reader."""
import os
import stat
from pathlib import Path
from unittest import mock

import pytest

from jscenegen.paths import (
    atomic_dir,
    check_output_dir,
    check_output_file,
    loads_json,
    read_json_object,
    refuse_run_file,
    require_new_dir,
    write_json,
)
from jscenegen.run_files import RUN_REPORTS, eval_update_stem, run_file_kind


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


@pytest.mark.parametrize("appears", ["files", "file", "empty dir"])
def test_atomic_dir_never_replaces_what_appeared_at_the_destination_while_writing(tmp_path, appears):
    """Two conversions to one new destination, or a user's files put there meanwhile: the
    late one is refused at publish time and nothing that is there is deleted."""
    out = tmp_path / "out"
    if appears == "empty dir":   # an empty directory is a new destination: replaced
        with atomic_dir(out) as d:
            out.mkdir()
            (d / "new").write_text("whole")
        assert sorted(p.name for p in out.iterdir()) == ["new"]
        return
    with pytest.raises(FileExistsError, match="something else wrote there meanwhile"):
        with atomic_dir(out) as d:
            (d / "new").write_text("whole")
            if appears == "files":
                out.mkdir()
                (out / "keep").write_text("precious")
            else:
                out.write_text("precious")
    kept = out / "keep" if appears == "files" else out
    assert kept.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # the temporary is removed


def test_atomic_dir_warns_of_a_killed_writers_temporary_and_keeps_it(tmp_path, caplog):
    left = tmp_path / ".out.partial-abc123"
    (left / "0").mkdir(parents=True)
    with caplog.at_level("WARNING"), atomic_dir(tmp_path / "out") as d:
        (d / "f").write_text("x")
    assert caplog.messages == [
        f"{tmp_path} holds .out.partial-abc123, left by an earlier write of out that was killed "
        "(or one still running): remove it once no command writes there"]
    assert left.is_dir() and (tmp_path / "out" / "f").read_text() == "x"


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


def test_a_replaced_file_keeps_its_permissions(tmp_path):
    secret = tmp_path / "report.json"
    secret.write_text("{}")
    secret.chmod(0o600)
    write_json(secret, {"a": 1})
    assert secret.stat().st_mode & 0o777 == 0o600 and '"a": 1' in secret.read_text()


def test_a_target_that_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path):
    fifo, link, target = tmp_path / "fifo", tmp_path / "link", tmp_path / "target.json"
    os.mkfifo(fifo)
    target.write_text("kept")
    link.symlink_to(target)
    for path, kind in ((fifo, "a named pipe"), (link, "a symbolic link"),
                       (Path(os.devnull), "a character device")):
        with pytest.raises(ValueError, match=f"{path}: is {kind}, not a regular file"):
            write_json(path, {"a": 1})
        with pytest.raises(ValueError, match=f"-o {path}: is {kind}"):
            check_output_file(path, "-o")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink()
    assert stat.S_ISCHR(os.lstat(os.devnull).st_mode) and target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link", "target.json"]


def test_check_output_file_tries_to_create_a_file_where_it_would_write(tmp_path):
    with pytest.raises(ValueError, match=r"--out /proc/r.json: cannot create a file in /proc"):
        check_output_file("/proc/r.json", "--out")
    check_output_file(tmp_path / "new" / "r.json", "--out")   # missing parents are fine
    with pytest.raises(ValueError, match=r"ends with /, the name of a directory"):
        check_output_file(f"{tmp_path}/new.json/", "-o")
    assert sorted(tmp_path.iterdir()) == []
    # an existing directory is named as one, whatever suffix the writer wants (`scene render
    # -o DIR` said "give a name ending in .png")
    for suffix in (".png", None):
        with pytest.raises(ValueError, match=f"^-o {tmp_path}: is a directory; give a file path$"):
            check_output_file(tmp_path, "-o", suffix)


def test_outputs_never_land_inside_a_checkpoint_or_become_a_run_step(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "1"
    step.mkdir(parents=True)
    (step / "checksums.json").write_text("{}")
    for out in (step / "run", step / "deeper" / "x"):
        with pytest.raises(ValueError, match=rf"--run-dir {out}: lies inside the checkpoint {step};"):
            check_output_dir(out, label="--run-dir")
    with pytest.raises(ValueError, match=rf"--out {step / 'r.json'}: lies inside the checkpoint"):
        check_output_file(step / "r.json", "--out")
    with pytest.raises(FileExistsError, match=r"would be a step of the run's checkpoint directory"):
        require_new_dir(step.parent / "2")
    check_output_dir(step.parent / "exported")        # a name the trainer does not read as a step
    check_output_dir(step.parent / "02")              # nor this one (no leading zeros in a step)
    check_output_dir(tmp_path / "run" / "other")      # beside the checkpoints: fine
    assert sorted(p.name for p in step.parent.iterdir()) == ["1"]


def test_a_failed_atomic_dir_removes_the_parents_it_created_and_a_link_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(tmp_path / "a" / "b" / "c" / "out") as tmp:
            (tmp / "f").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "kept" / "new" / "out"):
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        with pytest.raises(FileExistsError, match=rf"{name}: is a symbolic link"):
            with atomic_dir(tmp_path / name):
                pass
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()


def test_a_full_disk_while_writing_names_the_file(tmp_path):
    import errno

    from jscenegen.cli import error_line
    from jscenegen.paths import atomic_file

    with pytest.raises(OSError) as info:
        with atomic_file(tmp_path / "scene.json"):
            raise OSError(errno.ENOSPC, "No space left on device")   # what write() raises
    assert info.value.filename == str(tmp_path / "scene.json")
    assert error_line(info.value) == (f"no space left on device in {tmp_path} writing "
                                      f"{tmp_path / 'scene.json'}")
    assert list(tmp_path.iterdir()) == []


def test_storage_limits_are_read_from_errno_or_a_librarys_text(tmp_path):
    import errno

    from jscenegen.paths import DiskFullError, storage_limit, write_text

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert storage_limit(OSError(code, os.strerror(code))) == code
        try:
            raise ValueError(f'OUT_OF_RANGE: Failed writing: {os.strerror(code)} [os_error_code={code}]')
        except ValueError as inner:
            try:
                raise RuntimeError("the save failed") from inner
            except RuntimeError as outer:
                assert storage_limit(outer) == code
    assert storage_limit(OSError(errno.EACCES, "Permission denied")) is None
    assert storage_limit(None) is None
    # words in a path or a refusal are not an errno
    assert storage_limit(FileNotFoundError(errno.ENOENT, "No such file", "/d/File too large/x")) is None
    assert storage_limit(ValueError("scene rejected: File too large (max 1 MB)")) is None

    def limited_write(*args):
        raise OSError(errno.EFBIG, "File too large")

    with mock.patch("os.fsync", limited_write), pytest.raises(DiskFullError) as info:
        write_text(tmp_path / "scene.json", "{}")
    assert info.value.errno == errno.EFBIG
    assert str(info.value) == (f"file too large in {tmp_path}: writing scene.json needs 2 bytes "
                               "(larger than the file system allows); write to a file system that "
                               "takes larger files")   # no file-size limit set: the file system's
    assert list(tmp_path.iterdir()) == []


class _Refused(Exception):
    pass


@pytest.mark.parametrize("content,why", [
    ("[1]", "expected a JSON object, got list"), ('"x"', "expected a JSON object, got str"),
    ("{bad", "not valid JSON: Expecting property name"), (b"\xff", "not valid JSON: 'utf-8' codec"),
    ('{"a": 1, "a": 2}', "not valid JSON: the key 'a' appears twice in one object"),
    ("[" * 100_000, "not valid JSON: nested too deeply")])
def test_read_json_object_names_the_file_and_what_is_wrong(tmp_path, content, why):
    f = tmp_path / "doc.json"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(_Refused, match=f"^{f}: {why}"):
        read_json_object(f, _Refused)


def test_read_json_object_reads_an_object_and_refuses_what_is_no_file(tmp_path):
    f = tmp_path / "doc.json"
    f.write_text('{"a": [1, 2]}')
    assert read_json_object(f) == {"a": [1, 2]}
    for path, why in ((tmp_path / "absent.json", "no such file"), (tmp_path, "is a directory")):
        with pytest.raises(_Refused, match=f"^{path}: {why}$"):
            read_json_object(path, _Refused)
    os.mkfifo(tmp_path / "fifo")             # reading it would wait for a writer forever
    with pytest.raises(ValueError, match="is a named pipe$"):
        read_json_object(tmp_path / "fifo")


def test_read_json_object_reads_no_more_than_its_limit(tmp_path, monkeypatch):
    """A manifest, metadata or config.json of several GB was read and parsed whole."""
    f = tmp_path / "checksums.json"
    f.write_text('{"files": {}}' + " " * 100)
    assert read_json_object(f, _Refused, max_bytes=113) == {"files": {}}
    read = []
    real_open = open

    def counting_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        real_read = handle.read
        handle.read = lambda n=-1: read.append(n) or real_read(n)
        return handle

    monkeypatch.setattr("builtins.open", counting_open)
    with pytest.raises(_Refused, match=rf"^{f}: more than 112 bytes.*MAX_JSON_OBJECT_BYTES\)$"):
        read_json_object(f, _Refused, max_bytes=112)
    assert read == [113]


def test_a_name_longer_than_the_file_system_allows_is_refused_as_such(tmp_path):
    """An over-long component made `Path.exists` raise ENAMETOOLONG, reported against whatever
    path was looked at first (`--run-dir NAME/checkpoints: File name too long`)."""
    long = "b" * 256
    with pytest.raises(ValueError, match=rf"^-o {tmp_path}/{long}: the name is 256 bytes, at most 255 here "
                                         r"\(the file system allows 255\)$"):
        check_output_file(tmp_path / long, "-o")
    with pytest.raises(ValueError, match=r"^--run-dir .*: the name is 256 bytes, at most 237 here"):
        check_output_dir(tmp_path / long, label="--run-dir")
    for check in (lambda p: check_output_file(p, "-o"), check_output_dir):
        with pytest.raises(ValueError, match=r": the directory name b{40}\.\.\. is 256 bytes, more than "
                                             r"the file system allows \(255\)$"):
            check(tmp_path / long / "x")
    assert list(tmp_path.iterdir()) == []


def test_loads_json_refuses_numbers_infinite_as_a_float_only_when_asked():
    for text in ("1e400", "-1e400", "9" * 401):
        with pytest.raises(ValueError, match=r"too large for a float \(beyond 1\.8e308\)$"):
            loads_json(f"[{text}]", allow_nan=False)
    assert loads_json("[1e308, -1e308]", allow_nan=False) == [1e308, -1e308]
    assert loads_json("9" * 308, allow_nan=False) == int("9" * 308)
    assert loads_json("[1e400]") == [float("inf")]   # the other callers parse as Python does
    with pytest.raises(ValueError, match=r"^an integer of more than 4,300 digits$"):
        loads_json("1" * 5000, allow_nan=False)


def test_atomic_dir_syncs_every_file_before_publishing_and_the_rename_after(tmp_path, monkeypatch):
    """Shards written inside an atomic directory were never fsynced: after a power cut a
    published export could hold a valid config.json beside zero-filled weight files."""
    import jscenegen.paths as paths

    synced, published = [], []
    real = paths.fsync_path
    out = tmp_path / "model"
    monkeypatch.setattr(paths, "fsync_path", lambda p: (synced.append(Path(p)),
                                                        published.append(out.exists()), real(p))[2])
    with atomic_dir(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "model.safetensors").write_bytes(b"x" * 10)
        (tmp / "sub" / "a.json").write_bytes(b"{}")
        (tmp / "link").symlink_to(tmp / "model.safetensors")
    names = [p.name for p in synced]
    assert {"model.safetensors", "a.json", "sub"} <= set(names) and "link" not in names
    assert synced[-1] == tmp_path                       # the rename, after every file
    assert published == [False] * (len(synced) - 1) + [True]   # the files before the rename
    assert (out / "model.safetensors").read_bytes() == b"x" * 10


def test_a_tensor_stream_ending_early_or_naming_a_stranger_is_named(tmp_path):
    """A stream with one tensor too few raised a bare StopIteration; a name the config does
    not have a bare KeyError."""
    import numpy as np

    from jscenegen.model.config import preset_config
    from jscenegen.model.hf_io import write_hf_dir
    from jscenegen.model.safetensors_stream import write_safetensors_streaming

    specs = {"a": ((2,), np.dtype(np.float32)), "b": ((3,), np.dtype(np.float32))}
    with pytest.raises(ValueError, match=rf"^{tmp_path}: the tensors ended before b \(announced 2, 1 "
                                         r"arrived\)$"):
        write_safetensors_streaming(tmp_path, specs, iter([("a", np.zeros(2, np.float32))]))
    cfg = preset_config("qwen3", "micro", vocab_size=300)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'm'}: tensor 'lm_head\.extra' is not one of "
                                         r"qwen3's tensors"):
        write_hf_dir(tmp_path / "m", cfg, iter([("lm_head.extra", np.zeros(2, np.float32))]))
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("value", ["", None])
def test_an_empty_jscenegen_cache_is_the_default_cache_not_the_working_directory(monkeypatch, value):
    """`JSCENEGEN_CACHE=` (an unset variable expanded) read as Path(""): the warm start's models
    went into the current directory."""
    from jscenegen.paths import cache_dir

    if value is None:
        monkeypatch.delenv("JSCENEGEN_CACHE", raising=False)
    else:
        monkeypatch.setenv("JSCENEGEN_CACHE", value)
    assert cache_dir() == Path.home() / ".cache" / "jscenegen"
    monkeypatch.setenv("JSCENEGEN_CACHE", "/some/cache")
    assert cache_dir() == Path("/some/cache")


@pytest.fixture
def run_dir(tmp_path):
    """A training run's directory (it holds run.json) with some of its files."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("run.json", "config.yaml", "run.lock", "eval_before.json", "metrics.jsonl"):
        (run / name).write_text("{}")
    return run


@pytest.mark.parametrize("given, owned, what", [
    ("eval_before.json", "eval_before.json", "evaluation report"),
    ("./metrics.jsonl", "metrics.jsonl", "log"),
    ("config.yaml", "config.yaml", "config"),
    ("sub/../config.yaml", "config.yaml", "config"),
    ("run.lock", "run.lock", "lock"),
    ("run.json", "run.json", "run record"),
    ("checkpoints/x.json", "checkpoints/x.json", "checkpoints/ directory"),
    ("swanlab/x.json", "swanlab/x.json", "swanlab/ directory"),
    ("hf_assets/config.json", "hf_assets/config.json", "hf_assets/ directory"),
    ("eval_update_12.png", "eval_update_12.png", "evaluation plot"),
])
def test_a_run_file_given_relative_to_the_run_directory_is_refused(run_dir, monkeypatch, given,
                                                                   owned, what):
    """Relative paths with the working directory in the run, `..` inside them, and paths
    under the run's directories name the run's own files as absolute ones do."""
    monkeypatch.chdir(run_dir)
    with pytest.raises(ValueError) as err:
        refuse_run_file(given, "--out")
    how = "replace" if os.path.lexists(run_dir / owned) else "write into"
    assert str(err.value) == (f"--out {given}: the training run {run_dir.resolve()} owns {owned} "
                              f"(its {what}); writing there would {how} the run's own; choose "
                              "another --out")


def test_a_run_file_reached_through_a_symlinked_run_directory_is_refused(run_dir, tmp_path):
    (tmp_path / "link").symlink_to(run_dir)
    (tmp_path / "elsewhere").mkdir()
    for given in (tmp_path / "link" / "eval_after.png",
                  tmp_path / "elsewhere" / ".." / "link" / "eval_before.json"):
        with pytest.raises(ValueError, match="owns eval_"):
            refuse_run_file(given, "--plot")
    assert refuse_run_file(tmp_path / "link" / "mine.json", "--out") is None


def test_a_new_path_the_run_owns_says_write_into_not_replace(run_dir):
    with pytest.raises(ValueError, match="would write into the run's own; choose another -o$"):
        refuse_run_file(run_dir / "eval_after.json", "-o")
    with pytest.raises(ValueError, match="would replace the run's own"):
        refuse_run_file(run_dir / "eval_before.json", "-o")


def test_swanlab_is_part_of_the_runs_layout():
    assert run_file_kind(("swanlab",)) == run_file_kind(("swanlab", "run-1", "x.log")) == "swanlab/ directory"
    assert run_file_kind(("swanlab.json",)) is None and run_file_kind(("sub", "swanlab")) is None


@pytest.mark.parametrize("owned", ["hf_assets", "checkpoints", "swanlab", "checkpoints/new",
                                   "eval_update_3.json"])
def test_no_output_directory_is_made_in_what_a_run_owns(run_dir, owned):
    """check_output_dir and require_new_dir (init-model, sft --out, convert, export, train
    --run-dir) refused only existing files there: RUN/hf_assets, new or empty, was accepted,
    and a resume then read it as the run's config and tokenizer."""
    with pytest.raises(ValueError, match=f"owns {owned} \\(its "):
        check_output_dir(run_dir / owned, label="--run-dir")
    with pytest.raises(FileExistsError, match=f"{run_dir / owned}: the training run .* owns "
                                              f"{owned} \\(its "):
        require_new_dir(run_dir / owned)
    assert not (run_dir / "hf_assets").exists() and not any((run_dir / "checkpoints").iterdir())


def test_other_directories_in_or_beside_a_run_are_made_as_before(run_dir, tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.yaml").write_text("{}")   # no run.json: not a run
    for path in (run_dir / "my_model", tmp_path / "other" / "hf_assets", tmp_path / "other" / "checkpoints"):
        assert require_new_dir(path) is None
        assert check_output_dir(path) is None
    assert check_output_dir(run_dir) is None   # train --run-dir RUN itself (a new start)


def test_the_report_names_the_trainer_writes_are_the_protected_ones():
    """The trainer and the pipeline name their reports through run_files (RUN_REPORTS,
    eval_update_stem), the names run_file_kind protects: one place for both."""
    assert eval_update_stem(12) == "eval_update_12"
    for stem in (*RUN_REPORTS, eval_update_stem(0), eval_update_stem(12)):
        assert run_file_kind((f"{stem}.json",)) == "evaluation report"
        assert run_file_kind((f"{stem}.png",)) == "evaluation plot"
    assert run_file_kind(("eval_update_x.json",)) is None
