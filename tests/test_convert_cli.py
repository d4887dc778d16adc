"""`jscenegen convert` end to end: convert, --inspect, --verify, and error exit codes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jscenegen.cli import main

from fsdp_fixtures import fixture_dir


def test_convert_inspect_verify(tmp_path, capsys):
    src = fixture_dir("qwen2_first_divisible")
    ckpt = src / "ckpt"
    assert main(["convert", "--inspect", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "verl-fsdp2" and info["world_size"] == 6 and info["layout"] == "run"
    assert info["placements"] == {"Shard(1)": 12, "Shard(0)": 15}
    assert info["adam_step"] == 3 and info["scheduler_last_epoch"] == 3
    assert info["mesh"] == {"dim_names": ["fsdp"], "device_type": "cpu"}

    out = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(out), "--from", "verl", "--to", "hf",
                 "--dtype", "float32"]) == 0
    ref = load_file(str(src / "reference/params.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert all(np.array_equal(got[k], ref[k]) for k in ref)
    capsys.readouterr()
    assert main(["convert", "--inspect", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["dtypes"] == {"F32": 27}

    assert main(["convert", "--verify", str(out)]) == 0
    assert "verify" in capsys.readouterr().out
    with open(out / "model.safetensors", "r+b") as f:  # flip one byte of the weights
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    assert main(["convert", "--verify", str(out)]) == 2
    assert "model.safetensors: SHA-256 differs" in capsys.readouterr().err


def test_inspect_and_verify_take_the_run_directory_convert_to_orbax_writes(tmp_path, capsys):
    """The README converts into RUN/checkpoints; `convert RUN` read it, while `--inspect RUN`
    said "not a checkpoint" and `--verify RUN` looked for RUN/checksums.json (helper-73)."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    run = tmp_path / "r5"
    assert main(["convert", str(ckpt), str(run / "checkpoints"), "--to", "orbax"]) == 0
    # what cannot come along is said when it is left behind (it was in the metadata only)
    assert "note: not carried into JAX: torch's RNG streams" in capsys.readouterr().err
    assert main(["convert", "--inspect", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "orbax-run" and info["steps"] == [3] and info["incomplete"] == {}
    assert main(["convert", "--verify", str(run)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{run / 'checkpoints'}: ") and out.endswith(
        " files verify against checksums.json"), out


def test_inspect_names_the_checkpoints_inside_a_directory_that_is_none(tmp_path, capsys):
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    parent = tmp_path / "runs"
    assert main(["convert", str(ckpt), str(parent / "hf_a"), "--from", "verl", "--to", "hf"]) == 0
    (parent / "notes").mkdir()
    capsys.readouterr()
    assert main(["convert", "--inspect", str(parent)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {parent}: not a checkpoint (recognised: an HF safetensors directory, "
                   "an orbax step or run directory, an export, VERL FSDP2 rank files); it holds "
                   "checkpoints (hf_a): inspect one of them"), err
    assert main(["convert", "--inspect", str(parent / "notes")]) == 2
    assert capsys.readouterr().err.strip().endswith("VERL FSDP2 rank files)")


@pytest.mark.parametrize("damage", ["missing", "fifo", "directory"])
def test_an_hf_directory_with_a_bad_config_json_is_read_as_hf_and_the_config_named(
        tmp_path, capsys, damage):
    """`--inspect` and a conversion without `--from` said "not a checkpoint" for an HF
    directory whose config.json was missing or a named pipe; `--from hf` named the file."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    hf = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(hf), "--from", "verl", "--to", "hf"]) == 0
    (hf / "checksums.json").unlink()   # as a release has none (else it names config.json)
    config = hf / "config.json"
    config.unlink()
    why = {"missing": "no such file", "fifo": "is a named pipe", "directory": "is a directory"}
    if damage == "fifo":
        os.mkfifo(config)
    elif damage == "directory":
        config.mkdir()
    capsys.readouterr()
    assert main(["convert", "--inspect", str(hf)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {config}: {why[damage]}")
    assert main(["convert", str(hf), str(tmp_path / "o"), "--to", "orbax"]) == 2
    err = capsys.readouterr().err
    assert f"{hf}: read as --from hf" in err and f"error: {config}: {why[damage]}" in err, err
    assert not (tmp_path / "o").exists()


def test_a_source_failing_its_checksums_is_named_in_one_line_as_the_user_gave_it(
        tmp_path, capsys, monkeypatch):
    """The refusal named the directory three times, relative and absolute: "bad/v: refused, the
    source does not match /abs/bad/v/checksums.json: /abs/bad/v: 1 file(s) fail ..."."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(ckpt), "bad/v", "--from", "verl", "--to", "verl"]) == 0
    rank = Path("bad/v/global_step_3/actor/model_world_size_6_rank_2.pt")
    size = rank.stat().st_size
    os.truncate(rank, size // 2)
    line = (f"error: {rank}: {size // 2} bytes, expected {size} (bad/v/checksums.json; 1 file "
            "fails)")
    capsys.readouterr()
    for src in ("bad/v", "bad/v/global_step_3/actor"):
        assert main(["convert", src, "out", "--to", "hf"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == line
    assert main(["convert", "--verify", "bad/v"]) == 2
    assert capsys.readouterr().err.strip() == line
    assert not Path("out").exists()


def test_convert_and_export_check_the_manifest_a_converted_run_holds_as_verify_does(
        tmp_path, capsys, monkeypatch):
    """`RUN/checkpoints/checksums.json` (a converter's orbax output lists its step there) was
    ignored by `convert RUN` and `export RUN`, while `convert --verify RUN` refused it: an
    entry outside the directory was converted without a word."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(ckpt), "run/checkpoints", "--to", "orbax"]) == 0
    manifest = Path("run/checkpoints/checksums.json")
    good = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({"files": {"../../etc/passwd": 1}}))
    capsys.readouterr()
    assert main(["convert", "--verify", "run"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"error: {manifest}: entry '../../etc/passwd' is not a relative POSIX path "
                    "inside run/checkpoints (no '..', '.', empty or absolute parts)"), line
    for src in ("run", "run/checkpoints", "run/checkpoints/3"):
        assert main(["convert", src, "out", "--to", "hf"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == line
    assert main(["export", "run", "pub", "--world-size", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == line
    # a well-formed manifest that disagrees with the step's own, or with the layout file
    rel = "3/training_metadata.json"
    manifest.write_text(json.dumps({"files": {**good["files"], rel: {
        **good["files"][rel], "sha256": "0" * 64}}}))
    assert main(["convert", "run", "out", "--to", "hf"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: run/checkpoints/{rel}: SHA-256 differs ({manifest}; 1 file fails)")
    manifest.write_text(json.dumps(good))
    layout = Path("run/checkpoints/checkpoint-layout.json")
    layout.write_text(layout.read_text() + " ")
    assert main(["convert", "run/checkpoints/3", "out", "--to", "hf"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {layout}: ")
    assert not Path("out").exists() and not Path("pub").exists()
    manifest.unlink()
    os.mkfifo(manifest)
    assert main(["convert", "run", "out", "--to", "hf"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {manifest}: is a named pipe"
    manifest.unlink()   # a run: the steps' own manifests only
    assert main(["convert", "run", "out", "--to", "hf"]) == 0


def test_cli_errors(tmp_path, capsys):
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    hf = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(hf), "--from", "verl", "--to", "hf"]) == 0
    # hf -> verl needs a world size; the refusal names the flag and writes nothing
    assert main(["convert", str(hf), str(tmp_path / "v"), "--from", "hf", "--to", "verl"]) == 2
    assert "--world-size" in capsys.readouterr().err and not (tmp_path / "v").exists()
    # an existing destination is never overwritten
    assert main(["convert", str(ckpt), str(hf), "--from", "verl", "--to", "hf"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "--verify", str(tmp_path)]) == 2
    assert "checksums.json: missing" in capsys.readouterr().err
    # --verify/--inspect convert nothing: what else was given was dropped silently (exit 0)
    for argv, named in ((["--verify", str(ckpt), str(tmp_path / "x")], "SRC"),
                        (["--verify", str(ckpt), "--to", "hf"], "--to"),
                        (["--inspect", str(ckpt), "--world-size", "3"], "--world-size")):
        assert main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: jscenegen convert {argv[0]} DIR takes no {named}: it converts "
                       "nothing (run the conversion on its own)\n"), err
    # a source path that is not UTF-8: safetensors and torch tracebacks, or a torch "refused
    # (weights_only load failed: UnicodeEncodeError)" blaming the file's contents
    odd = str(tmp_path).encode() + b"/v\xff"
    import os
    os.symlink(ckpt, odd)
    for argv, label in (([os.fsdecode(odd), str(tmp_path / "o"), "--to", "hf"], "SRC"),
                        (["--inspect", os.fsdecode(odd)], "--inspect")):
        assert main(["convert", *argv]) == 2
        assert capsys.readouterr().err == (f"error: {label} {tmp_path}/v\\udcff: the path is not "
                                           "UTF-8 text (byte b'\\xff' at "
                                           f"{len(str(tmp_path)) + 2}); give a UTF-8 name\n")
    assert main(["convert", "--verify", os.fsdecode(odd)]) == 2   # hashing takes any name
    assert "checksums.json: missing" in capsys.readouterr().err


def test_a_wrong_from_names_the_format_the_source_is(tmp_path, capsys):
    """Each reader refused in its own words ("no complete orbax checkpoint step here",
    "config.json: no such file"), none saying which format the source is."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    for given in ("orbax", "hf"):
        assert main(["convert", str(ckpt), str(tmp_path / given), "--from", given, "--to", "hf"]) == 2
        assert capsys.readouterr().err == (f"error: {ckpt}: --from {given}, but it is a VERL "
                                           "checkpoint: --from verl, or leave --from out\n")
    run = tmp_path / "run"
    assert main(["convert", str(ckpt), str(run), "--to", "orbax"]) == 0
    capsys.readouterr()
    assert main(["convert", str(run), str(tmp_path / "v"), "--from", "verl", "--to", "hf"]) == 2
    assert capsys.readouterr().err == (f"error: {run}: --from verl, but it is an orbax "
                                       "checkpoint: --from orbax, or leave --from out\n")
    hf = ckpt / "global_step_3/actor/huggingface"   # VERL's config folder beside the rank files
    assert main(["convert", str(hf), str(tmp_path / "h"), "--from", "verl", "--to", "hf"]) == 2
    assert capsys.readouterr().err.endswith(
        f"({hf} is the model-config folder of the VERL checkpoint {hf.parent}: convert that)\n")
    assert not any((tmp_path / d).exists() for d in ("orbax", "hf", "v", "h"))
    # rank files beside an HF model: both readers start there, --from chooses (read as HF
    # without it, and Adam's state would be left behind)
    both = tmp_path / "both"
    both.mkdir()
    for f in (ckpt / "global_step_3/actor").iterdir():
        (both / f.name).symlink_to(f)
    assert main(["convert", str(ckpt), str(tmp_path / "as_hf"), "--to", "hf"]) == 0
    for f in ("config.json", "model.safetensors"):
        (both / f).symlink_to(tmp_path / "as_hf" / f)
    assert main(["convert", str(both), str(tmp_path / "both_run"), "--from", "verl", "--to",
                 "orbax"]) == 0
    assert main(["convert", "--inspect", str(tmp_path / "both_run")]) == 0
    assert '"adam": "from the optim rank files"' in capsys.readouterr().out


def test_carried_from_flag(tmp_path, capsys):
    """Qwen3.5: `--carried-from` supplies mtp.*; without it the warning reaches the user."""
    src = fixture_dir("qwen35_tied_frozen_dim0")
    assert main(["convert", str(src / "ckpt"), str(tmp_path / "with"), "--from", "verl",
                 "--to", "hf", "--carried-from", str(src / "release")]) == 0
    with_mtp = json.loads((tmp_path / "with/checkpoint-layout.json").read_text())
    assert len(with_mtp["carried_from_tensors"]) == 15 and not with_mtp["dropped"]
    capsys.readouterr()
    assert main(["convert", str(src / "ckpt"), str(tmp_path / "without"), "--from", "verl",
                 "--to", "hf"]) == 0
    assert "--carried-from" in capsys.readouterr().err  # the ConversionWarning, on stderr
    assert main(["convert", str(src / "release"), str(tmp_path / "v"), "--from", "hf", "--to",
                 "verl", "--world-size", "2", "--carried-from", str(src / "release")]) == 2
    assert "--carried-from completes a VERL source" in capsys.readouterr().err


_LIMITED_WRITE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))   # Python ignores SIGXFSZ: EFBIG
from jscenegen.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # three processes, ~25 s on 2 cores
def test_a_failed_write_is_one_line_naming_the_file(tmp_path):
    """A file-size limit (as a full disk would) made torch.save raise a 42-line RuntimeError
    traceback and the safetensors writer print "[Errno 27] File too large" naming nothing;
    then both gave one line without the bytes or the limit ("torch.save could not write the
    file (... unexpected pos ...)"). Now each is the orbax writer's disk-full line: the
    destination directory, the file's bytes and the limit."""
    import os
    import subprocess
    import sys

    src = fixture_dir("qwen2_first_divisible") / "ckpt"
    cases = [(["convert", str(src), str(tmp_path / "hf"), "--from", "verl", "--to", "hf"],
              f"{tmp_path / 'hf'}: writing model.safetensors"),
             (["convert", str(src), str(tmp_path / "verl"), "--from", "verl", "--to", "verl",
               "--world-size", "2"],
              f"{tmp_path / 'verl'}/global_step_3/actor: writing model_world_size_2_rank_0.pt")]
    for argv, where in cases:
        proc = subprocess.run([sys.executable, "-c", _LIMITED_WRITE, *argv], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        import re
        assert re.fullmatch(rf"error: file-size limit \(ulimit -f\) reached in {re.escape(where)} "
                            r"needs [\d,]+ bytes \(the limit is 60,000 bytes per file\); raise the "
                            r"limit or write elsewhere", lines[0]), lines[0]
    assert sorted(os.listdir(tmp_path)) == []          # no partial destination
    # orbax's writer threads outlived the failed save and wrote its manifest after the cleanup
    proc = subprocess.run([sys.executable, "-c", _LIMITED_WRITE, "convert", str(src),
                           str(tmp_path / "orbax"), "--from", "verl", "--to", "orbax"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: file-size limit (ulimit -f) reached in {tmp_path}/"), line
    assert line.endswith(" bytes (the limit is 60,000 bytes per file); raise the limit or write elsewhere")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_full_disk_while_writing_weights_names_the_bytes_needed_and_free(tmp_path, capsys,
                                                                           monkeypatch):
    """A full disk while torch.save wrote a VERL rank file gave "torch.save could not write
    the file ([enforce fail at inline_container.cc:672] . unexpected pos ...)" and the
    safetensors writer "no space left on device in DIR writing FILE": neither said how many
    bytes the write needs or how many are free, as the orbax writer's message does."""
    import errno
    import re

    import torch

    import jscenegen.model.safetensors_stream as stream

    real_save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        """torch.save on a full disk: its writer's OSError, chained to torch's RuntimeError."""
        if not hasattr(f, "write") or hasattr(f, "fileno"):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904 (torch chains it so)
        return real_save(obj, f, *args, **kwargs)   # the byte counter

    class FullFile:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    src = fixture_dir("qwen2_first_divisible") / "ckpt"
    monkeypatch.setattr(torch, "save", full_disk_save)
    monkeypatch.setattr(stream, "open", FullFile, raising=False)
    cases = [(["--to", "verl", "--world-size", "2"],
              f"{tmp_path / 'out'}/global_step_3/actor: writing the VERL rank files"),
             (["--to", "hf"], f"{tmp_path / 'out'}: writing the safetensors weights")]
    for args, where in cases:
        capsys.readouterr()
        assert main(["convert", str(src), str(tmp_path / "out"), "--from", "verl", *args]) == 2
        line = capsys.readouterr().err.strip()
        m = re.fullmatch(rf"error: no space left on device in {re.escape(where)} needs ([\d,]+) "
                         r"bytes \([\d,]+ bytes free\); free some space or write elsewhere", line)
        assert m and int(m.group(1).replace(",", "")) > 10_000, line
        assert os.listdir(tmp_path) == []   # no partial destination


def test_success_lines_escape_a_newline_in_a_path(tmp_path, capsys):
    """A destination named 'new\\nline' printed its success line as two lines."""
    out = tmp_path / "new\nline"
    assert main(["convert", str(fixture_dir("qwen2_first_divisible") / "ckpt"), str(out),
                 "--to", "hf"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{fixture_dir('qwen2_first_divisible') / 'ckpt'} (verl) -> {tmp_path}/new\\nline (hf)\n"
    assert (out / "model.safetensors").is_file()


def test_an_incomplete_newer_step_is_named_when_a_run_directory_is_converted(tmp_path, capsys):
    """`convert RUN` took the newest complete step without a word, while --inspect called the
    incomplete newer one "latest"."""
    import shutil

    run = tmp_path / "run"
    assert main(["convert", str(fixture_dir("qwen2_first_divisible") / "ckpt"), str(run),
                 "--to", "orbax"]) == 0
    (step,) = [p for p in run.iterdir() if p.name.isdigit()]
    for newer in ("9", "11"):
        shutil.copytree(step, run / newer)
        (run / newer / "commit_success.txt").unlink()
    capsys.readouterr()
    assert main(["convert", "--inspect", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == [int(step.name), 9, 11] and list(info["incomplete"]) == ["9", "11"]
    assert "commit_success.txt: missing" in info["incomplete"]["9"]
    assert info["latest"]["adam_count"] == int(step.name)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "skipping" in ln]   # one line for both steps
    assert line.startswith(f"warning: {run}: skipping step 11 (")
    assert ", step 9 (" in line
    assert line.endswith(f"; converting step {step.name}, the newest complete one")


def test_hf_and_verl_sources_with_a_tokenizer_that_does_not_load_are_refused_up_front(tmp_path,
                                                                                     capsys):
    """Every direction carries the source's model files as they are: a broken tokenizer.json
    was converted without a word (helper-83), and refused only after the weights were written
    (helper-86)."""
    import shutil

    from jscenegen.checkpoint.checksums import write_checksums

    ckpt = tmp_path / "verl"
    shutil.copytree(fixture_dir("qwen2_first_divisible") / "ckpt", ckpt, symlinks=True)
    hf = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(hf), "--from", "verl", "--to", "hf"]) == 0
    for source, fmt in ((hf, "hf"), (ckpt, "verl")):
        [tokenizer] = [p for p in source.rglob("tokenizer.json")]
        tokenizer.write_bytes(b"{not a tokenizer")
        if (tokenizer.parent / "checksums.json").exists() or (source / "checksums.json").exists():
            for sums in source.rglob("checksums.json"):
                write_checksums(sums.parent)
        capsys.readouterr()
        assert main(["convert", str(source), str(tmp_path / f"out-{fmt}"), "--from", fmt,
                     "--to", "orbax"]) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"error: {tokenizer}: not a tokenizer that tokenizers ")
        assert not (tmp_path / f"out-{fmt}").exists()


def _irregular(kind: str):
    def make(f):
        if kind == "named pipe":
            os.mkfifo(f)
        elif kind == "directory":
            f.mkdir()
        else:
            f.symlink_to(f.parent / "gone")
    return make


@pytest.mark.parametrize("name,make,why", [
    ("chat_template.jinja", _irregular("named pipe"), "is a named pipe; the model's chat_template.jinja "
                                                      "must be a regular file (or absent)"),
    ("chat_template.jinja", _irregular("directory"), "is a directory; the model's"),
    ("generation_config.json", _irregular("broken link"), "is a broken symbolic link; the model's"),
    ("generation_config.json", lambda f: f.write_text(""), "not valid JSON: empty: no JSON value"),
    ("generation_config.json", lambda f: f.write_text(" \n"), "not valid JSON: only whitespace: no JSON value"),
    ("preprocessor_config.json", lambda f: f.write_text("[1]"), "expected a JSON object, got list")])
def test_a_model_file_that_would_be_dropped_or_carried_unreadable_is_refused(tmp_path, capsys, name, make, why):
    """An asset that is not a regular file was left out of the output without a word (exit 0,
    and the output's checksums then verified without it); an empty generation_config.json was
    carried into an HF output transformers cannot load."""
    from hf_fixtures import make_hf_dir

    src = make_hf_dir(tmp_path / "hf", "qwen3")
    (src / name).unlink(missing_ok=True)
    make(src / name)
    for to in ("orbax", "verl"):
        assert main(["convert", str(src), str(tmp_path / to), "--from", "hf", "--to", to,
                     "--world-size", "2"][:None if to == "verl" else -2]) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {src / name}: {why}")
        assert not (tmp_path / to).exists()


def test_a_named_pipe_among_a_models_files_does_not_hold_a_tokenizer_load(tmp_path):
    """transformers' tokenizer loader opened chat_template.jinja and waited for a writer."""
    from jscenegen.model.tokenizer.chat import ChatTemplateError, ChatTokenizer

    from hf_fixtures import make_hf_dir

    src = make_hf_dir(tmp_path / "hf", "qwen3")
    os.mkfifo(src / "chat_template.jinja")
    with pytest.raises(ChatTemplateError, match=rf"^{src / 'chat_template.jinja'}: is a named pipe"):
        ChatTokenizer.from_dir(src)


def test_a_non_asset_entry_that_is_no_regular_file_is_named_not_copied(tmp_path, caplog):
    from jscenegen.model.assets import copy_non_weights

    src = tmp_path / "src"
    src.mkdir()
    (src / "LICENSE").write_text("terms")
    os.mkfifo(src / "README.md")
    (src / "sub").mkdir()
    with caplog.at_level("WARNING"):
        copied = copy_non_weights(src, tmp_path / "dst")
    assert [p.name for p in copied] == ["LICENSE"] and sorted(os.listdir(tmp_path / "dst")) == ["LICENSE"]
    assert [r.getMessage() for r in caplog.records] == [f"{src / 'README.md'}: is a named pipe; not copied"]


def test_links_out_of_the_source_are_named_not_copied(tmp_path, caplog):
    """A non-weight entry linking to a file outside the source directory (`notes.txt ->
    /tmp/secret.txt`) is left out, all such named in one warning; a link inside the directory
    and a model file linking out (a Hugging Face cache snapshot's blobs) are copied."""
    from jscenegen.model.assets import copy_non_weights

    secret, blob = tmp_path / "secret.txt", tmp_path / "blob"
    secret.write_text("password")
    blob.write_text("{}")
    src = tmp_path / "src"
    src.mkdir()
    (src / "LICENSE").write_text("terms")
    (src / "notes.txt").symlink_to(secret)
    (src / "more.txt").symlink_to("../secret.txt")
    (src / "COPYING").symlink_to("LICENSE")
    (src / "config.json").symlink_to(blob)
    with caplog.at_level("WARNING"):
        copied = copy_non_weights(src, tmp_path / "dst")
    assert [p.name for p in copied] == ["COPYING", "LICENSE", "config.json"]
    assert sorted(os.listdir(tmp_path / "dst")) == ["COPYING", "LICENSE", "config.json"]
    assert (tmp_path / "dst" / "COPYING").read_text() == "terms"
    assert [r.getMessage() for r in caplog.records] == [
        f"{src / 'more.txt'} -> {secret}, {src / 'notes.txt'} -> {secret}: not copied: symbolic "
        f"links to files outside {src}"]


def test_a_hugging_face_cache_snapshots_license_and_readme_are_copied(tmp_path, caplog):
    """Every file of a cache snapshot links into ../../blobs: the LICENSE and README of a model
    converted from one were left out as links outside the source."""
    from jscenegen.model.assets import copy_non_weights

    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "b1").write_text("terms")
    (tmp_path / "secret.txt").write_text("password")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "LICENSE").symlink_to("../../blobs/b1")
    (snapshot / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with caplog.at_level("WARNING"):
        copied = copy_non_weights(snapshot, tmp_path / "dst")
    assert [p.name for p in copied] == ["LICENSE"]
    assert (tmp_path / "dst" / "LICENSE").read_text() == "terms"
    assert "notes.txt" in caplog.text and "outside" in caplog.text


def test_a_verl_reshard_keeps_the_sources_mesh_device(tmp_path, capsys):
    """--mesh-device defaulted to cuda: a gloo run's checkpoint resharded came back on a cuda
    mesh, which torch then refused to load into the gloo run's parameters."""
    ckpt = fixture_dir("qwen2_first_divisible") / "ckpt"
    for argv, device in (([], "cpu"), (["--mesh-device", "cuda"], "cuda")):
        out = tmp_path / f"out-{device}"
        assert main(["convert", str(ckpt), str(out), "--from", "verl", "--to", "verl",
                     "--world-size", "2", *argv]) == 0
        capsys.readouterr()
        assert main(["convert", "--inspect", str(out)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["world_size"], info["mesh"]["device_type"]) == (2, device)


def test_inspect_summarises_a_converted_qwen35_steps_long_lists(tmp_path, capsys):
    """A Qwen3.5 step converted from VERL printed every param-group index, tower tensor and
    carried tensor (~200 lines for a micro model, thousands at release size)."""
    src = fixture_dir("qwen35_tied_frozen_dim0")
    out = tmp_path / "run" / "checkpoints"
    assert main(["convert", str(src / "ckpt"), str(out), "--from", "verl", "--to", "orbax",
                 "--carried-from", str(src / "release")]) == 0
    capsys.readouterr()
    step = next(p for p in out.iterdir() if p.name.isdigit())
    assert main(["convert", "--inspect", str(step)]) == 0
    info = json.loads(capsys.readouterr().out)

    def lists(x):
        if isinstance(x, dict):
            return [y for v in x.values() for y in lists(v)]
        return [x, *[y for v in x for y in lists(v)]] if isinstance(x, list) else []

    assert max(len(x) for x in lists(info["source"])) <= 8
    carried = info["source"]["carried"]["carried_from_tensors"]
    assert carried["count"] == 15 and carried["first"][0].startswith("mtp.")


def test_verify_and_inspect_of_a_run_name_a_finished_step_that_lost_its_params(tmp_path, capsys):
    """`--verify RUN` and `--inspect RUN` listed only step directories holding params/: a
    finished step that lost them verified as if it were not there."""
    import shutil

    from jscenegen.checkpoint.store import CheckpointStore

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    (hf / "tokenizer.json").write_text("{}")
    run = tmp_path / "run"
    with CheckpointStore(run / "checkpoints") as store:
        for step in (1, 2):
            zeros = {"a": np.zeros((4, 3), np.float32)}
            store.save(step, params={"a": np.ones((4, 3), np.float32)},
                       adam={"count": np.int32(step), "mu": zeros, "nu": zeros},
                       train_state={"step": step}, hf_assets_dir=hf, shapes={"a": (4, 3)},
                       metadata={"git_commit": None, "protocol_hash": None, "schedule_hash": None,
                                 "optimizer_step": step, "effective_updates": step})
    step2 = run / "checkpoints" / "2"
    shutil.rmtree(step2 / "params")
    (run / "checkpoints" / "3").mkdir()   # an unfinished save: listed, never verified
    assert main(["convert", "--verify", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"{step2 / 'params' / 'manifest.ocdbt'}: missing" in err
    assert f"({step2 / 'checksums.json'}; " in err and err.rstrip().endswith("files fail)"), err
    assert main(["convert", "--inspect", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == [1, 2, 3] and info["latest"]["step"] == 1
    assert info["incomplete"]["2"] == f"{step2}: missing params"
    shutil.rmtree(run / "checkpoints" / "1")
    assert main(["convert", "--inspect", str(run)]) == 0   # was "not a checkpoint"
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "orbax-run" and info["steps"] == [2, 3] and info["latest"] is None


def test_warnings_are_printed_before_the_error_when_a_conversion_fails(tmp_path, capsys):
    """The ConversionWarnings of a conversion that then failed were lost: printed only after
    success (`convert.finite.watching` warns also when it fails)."""
    import shutil
    import zipfile

    actor = tmp_path / "global_step_3" / "actor"
    shutil.copytree(fixture_dir("qwen2_first_divisible") / "ckpt" / "global_step_3" / "actor", actor)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (actor / "huggingface" / name).unlink()
    f = actor / "model_world_size_6_rank_1.pt"      # corrupt one stored tensor: fails when read
    with zipfile.ZipFile(f) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(f.read_bytes())
    start = data.index(info.filename.encode(), info.header_offset) + len(info.filename)
    data[start + info.file_size // 2 + 64] ^= 0x01
    f.write_bytes(bytes(data))
    assert main(["convert", str(actor), str(tmp_path / "hf"), "--from", "verl", "--to", "hf"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 2, lines
    assert lines[0] == (f"warning: {actor / 'huggingface'}: no tokenizer (tokenizer.json or "
                        f"vocab.json); the HF model written to {tmp_path / 'hf'} has "
                        "none either: copy the model's tokenizer files in before using it"), lines
    assert lines[1].startswith(f"error: {f}: ") and "fail the CRC-32" in lines[1], lines
    assert not (tmp_path / "hf").exists()
