"""jscenegen/checkpoint/checksums.py: the `checksums.json` format (SHA-256 + bytes per file) and its checks."""
import hashlib
import json
import os
from pathlib import Path

import pytest

from jscenegen.checkpoint.checksums import (
    CHECKSUMS_NAME,
    ChecksumError,
    compute_checksums,
    read_checksums,
    sampled_file_digest,
    verify_checksums,
    write_checksums,
)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "sub" / "b.bin").write_bytes(bytes(range(256)) * 5000)  # > 1 MiB chunk
    (tmp_path / "sub" / "deeper" / "c").write_bytes(b"")
    return tmp_path


def test_format_is_sha256_and_bytes_per_relative_path(tree):
    written = write_checksums(tree)
    on_disk = json.loads((tree / "checksums.json").read_text())
    assert on_disk == written
    assert list(on_disk) == ["files"]
    assert sorted(on_disk["files"]) == ["a.txt", "sub/b.bin", "sub/deeper/c"]
    big = (tree / "sub" / "b.bin").read_bytes()
    assert on_disk["files"]["sub/b.bin"] == {"sha256": hashlib.sha256(big).hexdigest(),
                                             "bytes": len(big)}
    assert on_disk["files"]["sub/deeper/c"] == {"sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0}
    assert verify_checksums(tree) == 3
    assert not [p for p in tree.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_each_kind_of_damage_names_the_file(tree):
    write_checksums(tree)
    (tree / "a.txt").write_bytes(b"hellO")
    (tree / "sub" / "deeper" / "c").write_bytes(b"x")
    (tree / "new.txt").write_bytes(b"")
    with pytest.raises(ChecksumError) as err:
        verify_checksums(tree)
    msg = str(err.value)
    assert "a.txt: SHA-256 differs" in msg
    assert "sub/deeper/c: 1 bytes, expected 0" in msg
    assert "new.txt: not listed" in msg
    assert msg.endswith(f" ({tree / 'checksums.json'}; 3 files fail)") and len(msg.splitlines()) == 1
    # Size-only mode misses the same-size edit but still sees the resize.
    (tree / "new.txt").unlink()
    with pytest.raises(ChecksumError) as err:
        verify_checksums(tree, hash_files=False)
    assert "a.txt" not in str(err.value) and "sub/deeper/c" in str(err.value)
    (tree / "sub" / "b.bin").unlink()
    with pytest.raises(ChecksumError, match="sub/b.bin: missing"):
        verify_checksums(tree, hash_files=False)


def test_a_listed_file_replaced_by_a_named_pipe_or_a_directory_is_named_as_such(tree):
    """A named pipe in place of a listed file was reported as "missing" (helper-83)."""
    write_checksums(tree)
    (tree / "a.txt").unlink()
    os.mkfifo(tree / "a.txt")
    (tree / "sub" / "deeper" / "c").unlink()
    (tree / "sub" / "deeper" / "c").mkdir()
    with pytest.raises(ChecksumError) as err:
        verify_checksums(tree, hash_files=False)
    assert str(err.value) == (f"{tree / 'a.txt'}: is a named pipe; {tree / 'sub/deeper/c'}: is a "
                              f"directory ({tree / 'checksums.json'}; 2 files fail)")


def test_directory_links_are_not_followed(tree):
    os.symlink("..", tree / "sub" / "huggingface")  # an export's huggingface -> ../.. style loop
    assert sorted(compute_checksums(tree)["files"]) == ["a.txt", "sub/b.bin", "sub/deeper/c"]


def test_a_listed_file_under_a_linked_directory_fails(tree, tmp_path_factory):
    """A step whose sub-directory was replaced by a link to a copy verified: the files listed
    matched, and the linked directory's unlisted files were never looked at."""
    write_checksums(tree)
    elsewhere = tmp_path_factory.mktemp("copy") / "sub"
    os.rename(tree / "sub", elsewhere)
    os.symlink(elsewhere, tree / "sub")
    (elsewhere / "unlisted.bin").write_bytes(b"x")
    with pytest.raises(ChecksumError, match=r"sub/b\.bin: lies under the symbolic link sub .*"
                                            r"sub/deeper/c: lies under the symbolic link sub"):
        verify_checksums(tree)


def test_missing_or_malformed_checksum_file(tree):
    with pytest.raises(ChecksumError, match="checksums.json: missing"):
        verify_checksums(tree)
    (tree / "checksums.json").write_text("{not json")
    with pytest.raises(ChecksumError, match="not valid JSON"):
        read_checksums(tree)
    (tree / "checksums.json").write_text(json.dumps({"files": {"a.txt": {"sha256": "00"}}}))
    with pytest.raises(ChecksumError, match="entry 'a.txt'"):
        read_checksums(tree)
    # a key twice: which entry a reader keeps differs between readers; it was the last, silently
    (tree / "checksums.json").write_text('{"files": {}, "files": {}}')
    with pytest.raises(ChecksumError, match=r"checksums.json: not valid JSON: the key 'files' "
                                            r"appears twice in one object"):
        read_checksums(tree)


def test_a_checksum_file_that_is_not_a_regular_file_is_not_skipped(tree):
    """A checksums.json that was a named pipe or a link to a directory read as "missing", and
    a conversion then went on without verifying its source."""
    from jscenegen.checkpoint.checksums import covering_checksums

    os.mkfifo(tree / "checksums.json")
    with pytest.raises(ChecksumError, match=r"checksums.json: is a named pipe$"):
        verify_checksums(tree)
    assert covering_checksums(tree / "sub" / "b.bin") == (tree.resolve(), "sub/b.bin")


@pytest.mark.parametrize("rel", ["../outside.txt", "sub/../../outside.txt", "/etc/hostname",
                                 "./a.txt", "sub//b.bin"])
def test_an_entry_outside_the_directory_is_refused_before_any_file_is_read(tree, rel):
    (tree.parent / "outside.txt").write_bytes(b"not ours")
    write_checksums(tree)
    doc = json.loads((tree / "checksums.json").read_text())
    doc["files"][rel] = {"sha256": "0" * 64, "bytes": 8}
    (tree / "checksums.json").write_text(json.dumps(doc))
    with pytest.raises(ChecksumError, match=r"is not a relative POSIX path inside"):
        verify_checksums(tree)


@pytest.mark.parametrize("text,message", [("[]", "expected a JSON object, got list"),
                                          (b"\xff", "not valid JSON: 'utf-8' codec"),
                                          ("[" * 100000, "not valid JSON: nested too deeply")])
def test_malformed_training_metadata_is_one_error_naming_the_file(tmp_path, text, message):
    from jscenegen.checkpoint.store import CheckpointError, read_metadata

    f = tmp_path / "training_metadata.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=rf"training_metadata\.json: {message}"):
        read_metadata(tmp_path)


def test_write_checksums_flushes_every_file_and_directory_before_it_writes_them(tmp_path,
                                                                                 monkeypatch):
    """Nothing but checksums.json was synced: after a power cut the new step's small files
    could come back empty beside a durable checksums.json, the older steps already deleted."""
    import jscenegen.checkpoint.checksums as checksums
    import jscenegen.paths as paths

    step = tmp_path / "checkpoints" / "3"
    (step / "params" / "d").mkdir(parents=True)
    for rel in ("params/d/a", "params/b", "meta.json"):
        (step / rel).write_text(rel)
    synced = []
    real = paths.fsync_path

    def recording(path):
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(paths, "fsync_path", recording)
    monkeypatch.setattr(checksums, "fsync_path", recording)
    checksums.write_checksums(step)
    written = next(i for i, p in enumerate(synced) if CHECKSUMS_NAME in p.name)   # its temp file
    before = set(synced[:written])
    assert {step / "params/d/a", step / "params/b", step / "meta.json", step / "params/d",
            step / "params", step} <= before
    assert step in synced[written:] and step.parent in synced[written:]   # the renames


def test_a_source_reached_through_a_link_is_checked_against_its_own_manifest(tmp_path, monkeypatch):
    """x/training_state -> real/training_state: the source named through the link was checked
    against x/checksums.json (its path with the step's parts taken off), not real/'s
    (helper-139 #3)."""
    from convert.dispatch import verify_source
    from jscenegen.checkpoint.checksums import write_checksums

    step = tmp_path / "real" / "training_state" / "global_step_3"
    step.mkdir(parents=True)
    (step / "a.bin").write_bytes(b"x" * 10)
    write_checksums(tmp_path / "real")
    (tmp_path / "x").mkdir()
    os.symlink(tmp_path / "real" / "training_state", tmp_path / "x" / "training_state")
    monkeypatch.chdir(tmp_path)
    verify_source("real/training_state/global_step_3")
    verify_source("x/training_state/global_step_3")
    (step / "a.bin").write_bytes(b"y" * 10)     # and a changed file is still caught through it
    with pytest.raises(Exception, match="a.bin: SHA-256 differs"):
        verify_source("x/training_state/global_step_3")


def test_sampled_digest_tells_apart_weights_of_the_same_shapes_and_agrees_on_copies(tmp_path):
    """Two fine-tunes of one model: the same safetensors header and size, other tensor bytes."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (512, 64), "model.norm.weight": (64,)}
    for name, seed in (("a", 1), ("b", 2)):
        rng = np.random.default_rng(seed)
        save_file({k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()},
                  tmp_path / f"{name}.safetensors")
    a, b = (tmp_path / f"{n}.safetensors" for n in "ab")
    assert a.stat().st_size == b.stat().st_size > 16 * 4096   # blocks, not the whole file
    assert a.read_bytes()[:100] == b.read_bytes()[:100]        # the same header
    (tmp_path / "copy").write_bytes(a.read_bytes())
    assert sampled_file_digest(a) == sampled_file_digest(tmp_path / "copy") != sampled_file_digest(b)
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    before = sampled_file_digest(small)
    small.write_bytes(b"x" * 99 + b"y")                         # a small file is read whole
    assert sampled_file_digest(small) != before
    zeros = tmp_path / "zeros"
    zeros.write_bytes(bytes(16 * 4096 + 1000))
    longer = tmp_path / "longer"                                # every block it reads the same
    longer.write_bytes(bytes(16 * 4096 + 1001))
    assert sampled_file_digest(zeros) != sampled_file_digest(longer)   # the size tells them apart
