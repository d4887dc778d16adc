"""jscenegen/checkpoint/store.py: orbax training checkpoints saved on 3 x 2, restored anywhere."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jscenegen.checkpoint.metadata import training_metadata
from jscenegen.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    array_shapes,
    check_step,
    iter_arrays,
    padded_target,
    read_adam_count,
    read_train_state,
    storage_sharding,
    to_logical,
)
from jscenegen.model.config import QwenConfig
from jscenegen.model.weights import param_shapes

# Sizes chosen so that no dim 0 divides 6 except by padding (13 vocab, 10 FFN, 4 head dim).
CFG = QwenConfig(model_type="qwen2", vocab_size=13, hidden_size=8, intermediate_size=10,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
SHAPES = param_shapes(CFG)
TRAIN_STATE = {"update": 6, "effective_updates": 5, "schedule_position": 6,
               "rng_key": [0, 4294967295], "data_iterator": {"next_index": 3, "epoch": 0},
               "lr_schedule_count": 6, "redraws": {"scene_2": 1}}


def meta(step):
    return {"git_commit": "0123abc", "protocol_hash": "ph", "schedule_hash": "sh",
            "optimizer_step": step, "effective_updates": step - 1, "judge": {"kind": "rule"}}


@pytest.fixture(scope="module")
def mesh32():
    return jax.make_mesh((3, 2), ("fsdp", "sp"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_model")
    for name, text in {"config.json": '{"model_type": "qwen2"}', "tokenizer.json": "{}",
                       "tokenizer_config.json": "{}", "generation_config.json": "{}",
                       "chat_template.jinja": "{{ messages }}", "model.safetensors": "weights"}.items():
        (d / name).write_text(text)
    return d


def logical_values(seed):
    """Deterministic fp32 arrays at logical shape for params, mu, nu."""
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
            for _ in range(3)]


def padded_on(mesh, arrays, shapes=SHAPES, dtype=np.float32):
    """The trainer's layout: dim 0 zero-padded to a multiple of mesh.size, split over all axes."""
    target = padded_target(shapes, mesh)
    out = {}
    for n, x in arrays.items():
        buf = np.zeros(target[n].shape, dtype)
        buf[: x.shape[0]] = x
        out[n] = jax.device_put(buf, target[n].sharding)
    return out


def save_step(store, step, mesh, hf_dir, seed, **kw):
    params, mu, nu = logical_values(seed)
    store.save(step, params=padded_on(mesh, params),
               adam={"count": np.int32(step), "mu": padded_on(mesh, mu), "nu": padded_on(mesh, nu)},
               train_state=dict(TRAIN_STATE, update=step), metadata=meta(step),
               hf_assets_dir=hf_dir, shapes=SHAPES, **kw)
    return params, mu, nu


@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh32, hf_dir):
    """One run directory with steps 3 and 7 saved from the 3 x 2 mesh."""
    store = CheckpointStore(tmp_path_factory.mktemp("run") / "checkpoints", keep_last=3)
    save_step(store, 3, mesh32, hf_dir, seed=3)
    values = save_step(store, 7, mesh32, hf_dir, seed=7)
    return store, values


def test_storage_sharding_splits_only_dividing_dims(mesh32):
    assert storage_sharding((12, 8), mesh32).spec == P(("fsdp", "sp"), None)
    assert storage_sharding((13, 8), mesh32).spec == P(None, "sp")
    assert storage_sharding((10, 8), mesh32, padded=(12, 8)).spec == P("sp", None)
    assert storage_sharding((5,), mesh32).spec == P(None)


def test_a_storage_layout_off_dim_0_is_reached_without_xla_s_full_rematerialization(mesh32, capfd):
    """[13, 8] padded to [18, 8], split on dim 0 over all six devices, is stored split on dim
    1 over sp: compiled (as a multi-process save compiles every move), the direct reshard made
    XLA's partitioner replicate it first and say so on stderr on every process ("Involuntary
    full rematerialization"); the array goes through the whole layout instead. A storage
    layout that still splits dim 0 ([15, 8] -> P('fsdp', 'sp')) is an all-to-all: direct."""
    # the warning comes from compiling: no executable may come from the persistent cache
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        _reshard_compiled(mesh32, capfd)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _reshard_compiled(mesh32, capfd):
    from jscenegen.checkpoint.store import reshard_via

    fsdp = jax.sharding.NamedSharding(mesh32, P(("fsdp", "sp")))
    values = np.arange(13 * 8, dtype=np.float32).reshape(13, 8)
    padded = jax.device_put(np.pad(values, ((0, 5), (0, 0))), fsdp)
    target = storage_sharding((13, 8), mesh32, padded=(18, 8))
    assert target.spec == P(None, "sp") and reshard_via(target).spec == P()
    moved = jax.jit(lambda a: a, out_shardings=reshard_via(target))(padded)
    out = jax.jit(lambda a: a[:13], out_shardings=target)(moved)
    np.testing.assert_array_equal(np.asarray(out), values)
    assert "rematerialization" not in capfd.readouterr().err
    jax.jit(lambda a: a + 0, out_shardings=target)(padded)   # the direct move, compiled
    assert "Involuntary full rematerialization" in capfd.readouterr().err   # what it avoids
    split = storage_sharding((15, 8), mesh32, padded=(18, 8))
    assert split.spec == P("fsdp", "sp") and reshard_via(split) is split
    [logical] = to_logical({"w": padded}, {"w": (13, 8)}).values()
    assert logical.sharding.spec == P(None, "sp")
    np.testing.assert_array_equal(np.asarray(logical), values)


def test_to_logical_drops_padding_and_checks_shapes(mesh32):
    params, _, _ = logical_values(0)
    logical = to_logical(padded_on(mesh32, params), SHAPES)
    for n, x in logical.items():
        assert x.shape == SHAPES[n]
        np.testing.assert_array_equal(np.asarray(x), params[n])
    bad = dict(params, **{"model.norm.weight": np.zeros((8, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(8, 2\)"):
        to_logical(bad, SHAPES)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        to_logical(dict(params, **{"lm_head.weight": params["model.norm.weight"]}), SHAPES)


def test_stored_arrays_are_logical(saved):
    store, _ = saved
    shapes = array_shapes(store.step_path(7), "params")
    assert {n: s for n, (s, _) in shapes.items()} == SHAPES
    assert {n: s for n, (s, _) in array_shapes(store.step_path(7), "nu").items()} == SHAPES
    assert all(d == np.float32 for _, d in shapes.values())


@pytest.mark.parametrize("mesh_shape", [(6, 1), (1, 1)])
def test_restore_bitwise_on_another_mesh(saved, mesh_shape):
    store, (params, mu, nu) = saved
    mesh = jax.make_mesh(mesh_shape, ("fsdp", "sp"), devices=jax.devices()[: mesh_shape[0] * mesh_shape[1]])
    target = padded_target(SHAPES, mesh)
    ck = store.restore(target=target)
    assert ck.step == 7
    assert set(ck.adam) == {"count", "mu", "nu"}
    assert int(ck.adam["count"]) == 7 and ck.adam["count"].dtype == np.int32
    assert ck.adam["count"].sharding == NamedSharding(mesh, P())
    for got, want in ((ck.params, params), (ck.adam["mu"], mu), (ck.adam["nu"], nu)):
        assert list(got) == sorted(SHAPES)
        for n, x in got.items():
            assert x.shape == target[n].shape and x.dtype == np.float32
            assert x.sharding == target[n].sharding
            host = np.asarray(x)
            np.testing.assert_array_equal(host[: SHAPES[n][0]], want[n])
            assert not host[SHAPES[n][0]:].any(), f"{n}: padding rows must be zero"
    assert ck.train_state == dict(TRAIN_STATE, update=7)
    assert ck.metadata == dict(meta(7), frozen_tensors=[])  # nothing frozen in a dense model


def test_restore_without_mesh_gives_numpy(saved):
    store, _ = saved
    params, mu, nu = logical_values(3)
    ck = store.restore(3)
    assert ck.step == 3 and isinstance(ck.adam["count"], np.ndarray) and int(ck.adam["count"]) == 3
    for got, want in ((ck.params, params), (ck.adam["mu"], mu), (ck.adam["nu"], nu)):
        for n in SHAPES:
            assert isinstance(got[n], np.ndarray) and got[n].shape == SHAPES[n]
            np.testing.assert_array_equal(got[n], want[n])
    assert ck.train_state == dict(TRAIN_STATE, update=3)


def test_mesh_free_reader_streams_arrays(saved):
    store, (params, mu, nu) = saved
    path = store.step_path(7)
    assert read_adam_count(path) == 7
    assert read_train_state(path) == dict(TRAIN_STATE, update=7)
    got = dict(iter_arrays(path, "nu", ["model.norm.weight", "lm_head.weight"]))
    assert list(got) == ["model.norm.weight", "lm_head.weight"]
    np.testing.assert_array_equal(got["lm_head.weight"], nu["lm_head.weight"])
    assert {n for n, _ in iter_arrays(path, "params")} == set(SHAPES)
    with pytest.raises(CheckpointError, match="no array 'nope'"):
        next(iter_arrays(path, "mu", ["nope"]))


def test_step_is_self_contained(saved, hf_dir):
    store, _ = saved
    path = store.step_path(7)
    assert sorted(p.name for p in (path / "hf").iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json"]
    copied, source = (json.loads((d / "config.json").read_text()) for d in (path / "hf", hf_dir))
    weights = {str(a.dtype) for a in store.restore(7).params.values()}
    assert {k: v for k, v in copied.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert {copied.get("dtype"), copied.get("torch_dtype", copied.get("dtype"))} == weights
    listed = json.loads((path / "checksums.json").read_text())["files"]
    assert "training_metadata.json" in listed and "hf/tokenizer.json" in listed
    assert any(k.startswith("params/") for k in listed) and any(k.startswith("adam/") for k in listed)
    assert check_step(path).valid


def test_restore_target_must_fit(saved, mesh32):
    store, _ = saved
    target = padded_target(SHAPES, mesh32)
    del target["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing \['model\.norm\.weight'\]"):
        store.restore(7, target=target)
    target = padded_target(dict(SHAPES, **{"model.norm.weight": (8, 2)}), mesh32)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(12, 2\).*\(8,\)"):
        store.restore(7, target=target)


def test_keep_last_and_refuse_overwrite(tmp_path, mesh32, hf_dir):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save_step(store, step, mesh32, hf_dir, seed=step)
    assert store.steps() == [3, 4]
    assert all(s.valid for s in store.scan())
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint"):
        save_step(store, 4, mesh32, hf_dir, seed=0)
    with pytest.raises(CheckpointError, match=r"complete checkpoints after step 2 \(\[3, 4\]\)"):
        save_step(store, 2, mesh32, hf_dir, seed=0)
    assert store.steps() == [3, 4]


def test_keep_last_sets_a_finished_step_that_fails_its_sizes_aside(tmp_path, mesh32, hf_dir, caplog):
    """Garbage collection deleted a corrupt finished step (as "keep_last"), which the store
    otherwise only ever renames aside."""
    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2):
        save_step(store, step, mesh32, hf_dir, seed=step)
    meta = store.step_path(2) / "training_metadata.json"
    meta.write_bytes(meta.read_bytes()[:10])
    with caplog.at_level("WARNING"):
        save_step(store, 3, mesh32, hf_dir, seed=3)
    assert store.steps() == [1, 3]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("2.corrupt-")]
    assert len(aside) == 1 and len((aside[0] / "training_metadata.json").read_bytes()) == 10
    assert any("checkpoint step 2 is corrupt" in m and "set aside" in m for m in caplog.messages)


def test_a_kill_while_pruning_leaves_no_half_deleted_step(tmp_path, mesh32, hf_dir, monkeypatch,
                                                          caplog):
    """Pruning removed the step in place: a kill after params/ went left a step that still held
    its checksums.json, which the next save called corrupt and kept forever."""
    import jscenegen.checkpoint.store as store_mod

    store = CheckpointStore(tmp_path, keep_last=1)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        real_rmtree(Path(path) / "params")
        raise KeyboardInterrupt

    monkeypatch.setattr(store_mod.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_step(store, 2, mesh32, hf_dir, seed=2)
    monkeypatch.setattr(store_mod.shutil, "rmtree", real_rmtree)
    assert store.steps() == [2] and check_step(store.step_path(2)).valid
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".1.deleting-")]
    CheckpointStore(tmp_path, keep_last=1)      # the next start removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
    (tmp_path / ".1.deleting-7").mkdir()        # or the next save does
    with caplog.at_level("WARNING"):
        save_step(store, 3, mesh32, hf_dir, seed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]
    assert not any("corrupt" in m for m in caplog.messages)


def test_a_step_that_cannot_be_pruned_is_a_warning_not_a_failed_save(tmp_path, mesh32, hf_dir,
                                                                      monkeypatch, caplog):
    """A failed deletion of an older step raised from save() after the new step was complete:
    the trainer ended the run on a save that had succeeded."""
    import jscenegen.checkpoint.store as store_mod

    store = CheckpointStore(tmp_path, keep_last=1)
    save_step(store, 1, mesh32, hf_dir, seed=1)

    real_replace = os.replace

    def denied(src, dst, *args, **kwargs):
        if Path(src) == store.step_path(1):
            raise PermissionError(13, "Permission denied", str(src))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(store_mod.os, "replace", denied)
    with caplog.at_level("WARNING"):
        save_step(store, 2, mesh32, hf_dir, seed=2)
    monkeypatch.undo()
    assert store.steps() == [1, 2] and check_step(store.step_path(2)).valid
    assert any("step 1 in" in m and "could not be removed" in m and "Permission denied" in m
               for m in caplog.messages)
    save_step(store, 3, mesh32, hf_dir, seed=3)
    assert store.steps() == [3]


def test_every_process_resumes_from_the_step_process_0_chose(tmp_path, mesh32, hf_dir,
                                                              monkeypatch):
    """Each process listed and hashed the steps itself: hosts that see a shared filesystem
    differently (a client's cache just after a kill) resumed from different steps. Process 0
    now decides; another process that does not see that step complete stops every process.
    This process plays process 1, its collectives answered as process 0 would."""
    import jscenegen.checkpoint.store as store_mod

    store = CheckpointStore(tmp_path, keep_last=3)
    for step in (1, 2):
        save_step(store, step, mesh32, hf_dir, seed=step)
    wire = {"result": {"valid": [2, None], "skipped": [[3, "missing params", True]]}}
    monkeypatch.setattr(store_mod.jax, "process_count", lambda: 2)
    monkeypatch.setattr(store_mod.jax, "process_index", lambda: 1)
    monkeypatch.setattr(store_mod, "bytes_from_primary", lambda data: json.dumps(wire).encode())
    monkeypatch.setattr(store_mod, "max_over_processes", lambda value: value)
    moved = []
    monkeypatch.setattr(CheckpointStore, "_set_aside", lambda self, step, why: moved.append(step))
    assert store.set_aside_corrupt().step == 2 and moved == [3]   # process 0's corrupt step 3
    (store.step_path(2) / "training_metadata.json").unlink()      # here step 2 is incomplete
    with pytest.raises(CheckpointError, match=r"process 0 resumes from step 2, which another "
                                              r"process does not see complete"):
        store.set_aside_corrupt()
    wire = {"error": "PermissionError: [Errno 13] Permission denied: '2'"}
    with pytest.raises(CheckpointError, match=r"process 0 could not read the checkpoint steps: "
                                              r"PermissionError"):
        store.set_aside_corrupt()


def test_a_save_takes_process_0s_view_of_the_step_it_writes(tmp_path, hf_dir, monkeypatch):
    """Each process looked at the step it was about to write on its own; hosts seeing a shared
    filesystem differently took different branches (set aside, replace, write), each holding
    collectives. This process plays process 1; process 0 says step 2 is a finished, corrupt
    save (here it is absent), then refuses."""
    import jscenegen.checkpoint.store as store_mod

    store = CheckpointStore(tmp_path, keep_last=3)
    monkeypatch.setattr(store_mod.jax, "process_count", lambda: 2)
    monkeypatch.setattr(store_mod.jax, "process_index", lambda: 1)
    monkeypatch.setattr(store_mod, "bytes_from_primary",
                        lambda data: b'{"result": ["params: missing", true]}')
    status, finished = store._step_as_process_0_sees(2, hf_dir)
    assert (status.step, status.valid, status.reason, finished) == (2, False, "params: missing", True)
    monkeypatch.setattr(store_mod, "bytes_from_primary", lambda data: b'{"result": null}')
    assert store._step_as_process_0_sees(2, hf_dir) == (None, False)

    monkeypatch.setattr(store_mod, "bytes_from_primary", lambda data: json.dumps(
        {"refused": "process 0: .../checkpoints/2 already holds a complete checkpoint"}).encode())
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint"):
        store._step_as_process_0_sees(2, hf_dir)


def test_a_store_on_a_file_is_one_named_error(tmp_path):
    f = tmp_path / "checkpoints"
    f.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"checkpoints: not a directory"):
        CheckpointStore(f)


def test_a_train_state_item_that_is_no_object_is_one_named_error(tmp_path, mesh32, hf_dir):
    """restore() read it without the reader's checks: a bare TypeError / RecursionError."""
    from jscenegen.checkpoint.checksums import write_checksums

    store = CheckpointStore(tmp_path, keep_last=2)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    item = next(p for p in (store.step_path(1) / "train_state").iterdir() if p.is_file())
    for text in (b"[1, 2]", b"[" * 100_000, b"\xff\xfe"):
        item.write_bytes(text)
        (store.step_path(1) / "checksums.json").unlink()
        write_checksums(store.step_path(1))
        with pytest.raises(CheckpointError, match=r"/1(/train_state: the train state must be a "
                                                  r"JSON object, got list|: orbax cannot read)"):
            store.restore(1)


def test_the_json_files_orbax_parses_whole_are_bounded(tmp_path, mesh32, hf_dir):
    """train_state/metadata and a PyTree item's _METADATA were handed to orbax, which parses
    them whole (`json.loads(path.read_text())`): a step rewritten by another program with a
    multi-GB one, checksums recomputed, was read into memory by a resume or a conversion. Now
    each is refused unread past paths.MAX_JSON_OBJECT_BYTES, naming the file."""
    from jscenegen.checkpoint.checksums import write_checksums
    from jscenegen.paths import MAX_JSON_OBJECT_BYTES

    store = CheckpointStore(tmp_path, keep_last=2)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    step = store.step_path(1)
    big = b'{"x": "' + b" " * MAX_JSON_OBJECT_BYTES + b'"}'   # valid JSON, one string
    for item, name in (("train_state", "metadata"), ("params", "_METADATA")):
        path = step / item / name
        kept = path.read_bytes()
        path.write_bytes(big)
        (step / "checksums.json").unlink()
        write_checksums(step)    # as the program that rewrote it would
        too_large = rf"^{re.escape(str(path))}: more than {MAX_JSON_OBJECT_BYTES:,} bytes"
        with pytest.raises(CheckpointError, match=too_large):
            store.restore(1)
        with pytest.raises(CheckpointError, match=too_large):
            read_train_state(step) if item == "train_state" else array_shapes(step)
        path.write_bytes(kept)
    (step / "checksums.json").unlink()
    write_checksums(step)
    assert store.restore(1).train_state["update"] == 1   # each file at its size again


def test_async_save_completes_on_next_save_and_close(tmp_path, mesh32, hf_dir):
    store = CheckpointStore(tmp_path, keep_last=5, async_save=True)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    want = save_step(store, 2, mesh32, hf_dir, seed=2)
    assert check_step(store.step_path(1)).valid  # completed by the second save
    store.close()
    assert [s.step for s in store.scan() if s.valid] == [2, 1]
    ck = CheckpointStore(tmp_path).restore()
    assert ck.step == 2
    np.testing.assert_array_equal(ck.adam["mu"]["model.embed_tokens.weight"],
                                  want[1]["model.embed_tokens.weight"])


def test_save_rejects_bad_input(tmp_path, mesh32, hf_dir):
    store = CheckpointStore(tmp_path / "checkpoints")
    params, mu, nu = logical_values(0)
    good = dict(params=params, adam={"count": np.int32(1), "mu": mu, "nu": nu},
                train_state={}, metadata=meta(1), hf_assets_dir=hf_dir, shapes=SHAPES)
    half = {n: x.astype(np.float16) for n, x in mu.items()}
    with pytest.raises(CheckpointError, match=r"adam\['mu'\] must be float32"):
        store.save(1, **dict(good, adam={"count": 1, "mu": half, "nu": nu}))
    with pytest.raises(CheckpointError, match="count"):
        store.save(1, **dict(good, adam={"count": np.zeros(2, np.int32), "mu": mu, "nu": nu}))
    with pytest.raises(CheckpointError, match=r"metadata lacks \['schedule_hash'\]"):
        store.save(1, **dict(good, metadata={k: v for k, v in meta(1).items() if k != "schedule_hash"}))
    with pytest.raises(CheckpointError, match=r"optimizer_step \(2\) differs from adam\['count'\] \(1\)"):
        store.save(1, **dict(good, metadata=meta(2)))
    with pytest.raises(CheckpointError, match="train_state must be JSON"):
        store.save(1, **dict(good, train_state={"key": np.zeros(2)}))
    no_tokenizer = tmp_path / "hf"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no tokenizer"):
        store.save(1, **dict(good, hf_assets_dir=no_tokenizer))
    # a config.json that is not a JSON object: refused by name before any array is written
    # (it raised a bare JSONDecodeError after the arrays, leaving an incomplete step)
    bad_config = tmp_path / "hf_bad"
    shutil.copytree(hf_dir, bad_config)
    for text, why in (('{"a": 1,}', "not valid JSON"), ("[1]", "expected a JSON object, got list")):
        (bad_config / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=f"^{re.escape(str(bad_config / 'config.json'))}: {why}"):
            store.save(1, **dict(good, hf_assets_dir=bad_config))
    assert store.steps() == []  # nothing written by refused saves


def _corrupt(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_file_is_named_and_never_chosen(tmp_path, mesh32, hf_dir):
    store = CheckpointStore(tmp_path, keep_last=3)
    want = save_step(store, 1, mesh32, hf_dir, seed=1)
    save_step(store, 2, mesh32, hf_dir, seed=2)
    victim = max((p for p in (store.step_path(2) / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    rel = victim.relative_to(store.step_path(2)).as_posix()
    _corrupt(victim)
    assert store.latest_valid_step() == 1
    with pytest.raises(CheckpointError, match=f"{rel}: SHA-256 differs"):
        store.restore(2)
    ck = store.restore()
    assert ck.step == 1
    np.testing.assert_array_equal(ck.params["lm_head.weight"], want[0]["lm_head.weight"])
    (store.step_path(1) / "hf" / "tokenizer.json").write_text("{} ")
    with pytest.raises(CheckpointError, match="hf/tokenizer.json: 3 bytes, expected 2"):
        store.restore(1)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.restore()


def test_an_empty_step_directory_is_reported_by_the_store_alone(tmp_path, mesh32, hf_dir,
                                                                   caplog):
    """orbax logged "Metadata file does not exist" at every listing and restore (three lines
    for one resume) beside the store's own line naming the step and what it lacks."""
    store = CheckpointStore(tmp_path, keep_last=3)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    store.close()
    store.step_path(2).mkdir()
    with caplog.at_level("WARNING"):
        store = CheckpointStore(tmp_path, keep_last=3)
        assert store.restore().step == 1
        save_step(store, 2, mesh32, hf_dir, seed=2)
    assert "Metadata file does not exist" not in caplog.text
    assert caplog.text.count("checkpoint step 2: ") == 2     # restore's skip, save's replace
    assert "missing params, adam" in caplog.text
    assert store.latest_valid_step() == 2


def test_tensorstore_callbacks_into_a_closed_loop_print_nothing_once_the_store_is_imported():
    """A read or write cut short (a stop signal, a full disk) leaves tensorstore futures whose
    done callback posts to the event loop orbax has closed; tensorstore reports each failure as
    an unraisable exception, a bare 'Event loop is closed' traceback. The store's filter is
    installed when its module is imported (convert's reads never make a CheckpointStore), and
    it survives the command's `UnwindOnSignals`, which was entered before the import."""
    script = textwrap.dedent("""
        import asyncio, sys
        import tensorstore as ts

        def callback_into_a_closed_loop(then_raise=None):
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            promise, future = ts.Promise.new()
            future.__await__()             # what `await future` registers: a post to `loop`
            if then_raise:
                future.add_done_callback(lambda f: (_ for _ in ()).throw(then_raise))
            loop.close()
            promise.set_result(1)

        callback_into_a_closed_loop()      # printed: no filter yet
        from jscenegen.signals import UnwindOnSignals
        with UnwindOnSignals():
            import jscenegen.checkpoint.store  # noqa: F401
        callback_into_a_closed_loop(then_raise=ValueError("other failures still print"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("RuntimeError: Event loop is closed") == 1, out.stderr
    assert "ValueError: other failures still print" in out.stderr


def test_a_corrupt_step_is_set_aside_and_its_number_saved_again(tmp_path, mesh32, hf_dir, caplog):
    store = CheckpointStore(tmp_path, keep_last=1)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    save_step(store, 2, mesh32, hf_dir, seed=2)
    victim = max((p for p in (store.step_path(2) / "adam").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    rel = victim.relative_to(store.step_path(2)).as_posix()
    _corrupt(victim, offset=victim.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        store.restore()  # keep_last=1: step 1 is gone, step 2 is the only one and corrupt
    # nothing valid to go back to: a resume refuses, naming the step and file, and moves nothing
    with pytest.raises(CheckpointError, match=f"no valid checkpoint to resume from; corrupt: step 2 .*{rel}"):
        store.set_aside_corrupt()
    assert store.steps() == [2]
    with caplog.at_level("WARNING"):
        want = save_step(store, 2, mesh32, hf_dir, seed=22)  # a redo of the update saves step 2 again
    (aside,) = tmp_path.glob("2.corrupt-*")  # ... setting the corrupt one aside first
    assert (aside / rel).read_bytes() != b""
    assert rel in caplog.text and str(aside) in caplog.text
    ck = store.restore()
    assert ck.step == 2
    np.testing.assert_array_equal(ck.adam["nu"]["lm_head.weight"], want[2]["lm_head.weight"])
    save_step(store, 3, mesh32, hf_dir, seed=3)  # keep_last deletes step 2, never the set-aside copy
    assert store.steps() == [3] and aside.is_dir()
    # save itself sets aside a corrupt step at the number it writes (no resume in between)
    _corrupt(store.step_path(3) / "checksums.json", offset=5)
    save_step(store, 3, mesh32, hf_dir, seed=33)
    assert store.latest_valid_step() == 3
    assert len(list(tmp_path.glob("3.corrupt-*"))) == 1


@pytest.mark.parametrize("where", ["orbax", "checksums"])
def test_a_full_disk_names_the_directory_and_bytes_and_removes_the_failed_save(
        tmp_path, mesh32, hf_dir, monkeypatch, where):
    """ENOSPC while orbax commits the arrays (its temporary directory exists) or while the
    step is completed (the step directory exists): DiskFullError, and neither is left."""
    import errno

    from orbax.checkpoint._src.path import atomicity

    from jscenegen.checkpoint import store as checkpoint
    from jscenegen.cli import error_line
    from jscenegen.paths import DiskFullError

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    save_step(store, 1, mesh32, hf_dir, seed=1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "orbax":
        async def finalize(self, *args, **kwargs):
            assert list(store.directory.glob("2.orbax-checkpoint-tmp*"))  # arrays written
            full()
        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    else:
        monkeypatch.setattr(checkpoint, "write_checksums", full)
    with pytest.raises(DiskFullError) as info:
        save_step(store, 2, mesh32, hf_dir, seed=2)
    n = sum(x.size for x in logical_values(0)[0].values())
    assets = sum(p.stat().st_size for p in hf_dir.iterdir() if p.name != "model.safetensors")
    assert info.value.needed_bytes == 3 * 4 * n + assets  # params + Adam moments, fp32, + hf/
    line = error_line(info.value)
    assert line.startswith(f"no space left on device in {store.directory}: checkpoint step 2 "
                           f"needs {info.value.needed_bytes:,} bytes (")
    assert "\n" not in line
    assert sorted(p.name for p in store.directory.iterdir()) == ["1"]  # nothing of step 2 left
    monkeypatch.undo()
    save_step(store, 2, mesh32, hf_dir, seed=2)  # space freed: the same store saves the step
    assert store.latest_valid_step() == 2


def test_a_zero_padded_copy_of_a_step_is_not_read_as_that_step(tmp_path, mesh32, hf_dir, caplog):
    """`checkpoints/09` (a hand copy) read as step 9, then warned that `checkpoints/9` does not
    exist; nothing writes such names, so they are left alone as foreign entries."""
    import shutil

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    shutil.copytree(store.step_path(1), store.directory / "09")
    with caplog.at_level("WARNING"):
        assert store.steps() == [1] and store.latest_valid_step() == 1
    assert caplog.messages == []
    save_step(store, 2, mesh32, hf_dir, seed=2)
    assert sorted(p.name for p in store.directory.iterdir()) == ["09", "1", "2"]


_LIMITED_SAVE = textwrap.dedent("""
    import logging, resource, sys
    import jax
    sys.path.insert(0, {tests!r})
    import test_checkpoint as t
    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.cli import error_line
    from jscenegen.paths import DiskFullError
    logging.basicConfig(level=logging.WARNING)
    mesh = jax.make_mesh((3, 2), ("fsdp", "sp"))
    store = CheckpointStore(sys.argv[1], keep_last=2)
    t.save_step(store, 1, mesh, sys.argv[2], seed=1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        t.save_step(store, 2, mesh, sys.argv[2], seed=2)
    except DiskFullError as err:
        print(error_line(err))
""")


def test_a_file_size_limit_during_a_save_is_one_line_and_leaves_nothing(tmp_path, hf_dir):
    """The file-size limit (EFBIG, `ulimit -f`) hit by tensorstore's writers: the save raised
    orbax's raw OUT_OF_RANGE error, asyncio printed a traceback per writer task ('exception was
    never retrieved'), and the temporary directory stayed."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="6", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "checkpoints"
    out = subprocess.run([sys.executable, "-c", _LIMITED_SAVE.format(tests=str(Path(__file__).parent)),
                          str(run_dir), str(hf_dir)], capture_output=True, text=True, timeout=300, env=env)
    noise = ("Traceback", "never retrieved", "never awaited", "OUT_OF_RANGE", "File too large")
    assert out.returncode == 0 and not any(x in out.stderr for x in noise), out.stderr[-3000:]
    assert out.stdout.startswith(f"file-size limit (ulimit -f) reached in {run_dir}: checkpoint step 2 "
                                 "needs "), out.stdout
    assert out.stdout.endswith(" bytes (the limit is 2,000 bytes per file); raise the limit or write "
                               "elsewhere\n"), out.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == ["1"]
    assert CheckpointStore(run_dir).latest_valid_step() == 1


def test_a_failed_saves_leftovers_are_removed_again_when_a_late_writer_recreates_them(tmp_path):
    """Under load, a tensorstore write still in flight after the failed save recreated the
    temporary directory (an OCDBT manifest) after it was removed: the save's leftovers are
    removed until none reappears for the quiet period."""
    tmp = tmp_path / "2.orbax-checkpoint-tmp"
    calls = []

    def find():
        calls.append(tmp.exists())
        if len(calls) == 3:   # a late writer: the directory is back after the first removal
            (tmp / "params" / "ocdbt.process_0").mkdir(parents=True)
            (tmp / "params" / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"m")
        return [tmp] if tmp.exists() else []

    from jscenegen.checkpoint import store as checkpoint

    (tmp / "params").mkdir(parents=True)
    assert checkpoint._remove_until_settled(find, quiet_s=0.1, limit_s=5.0) == []
    assert not tmp.exists() and calls[:3] == [True, False, False] and len(calls) > 3


def test_a_failed_saves_leftover_is_warned_of_with_what_removes_it(tmp_path, monkeypatch, caplog):
    """The warning said every leftover is 'removed at the next start', but a start deletes only
    orbax's temporaries (and not while another process holds the lock); an incomplete step is
    deleted by the next completed save's cleanup or replaced by a re-save of that step."""
    import errno
    import logging

    from jscenegen.checkpoint import store as checkpoint
    from jscenegen.paths import DiskFullError

    store = CheckpointStore(tmp_path)
    (tmp_path / "5").mkdir()   # an incomplete step: no checksums.json
    (tmp_path / "5.orbax-checkpoint-tmp-1234").mkdir()
    monkeypatch.setattr(checkpoint, "_remove_until_settled", lambda find: find())   # none removed
    with caplog.at_level(logging.WARNING), pytest.raises(DiskFullError):
        store._raise_if_disk_full(OSError(errno.ENOSPC, "No space left on device"), 5, 1000)
    said = {r.getMessage() for r in caplog.records if "left by the failed save" in r.getMessage()}
    assert said == {
        f"could not remove {tmp_path / '5.orbax-checkpoint-tmp-1234'}, left by the failed save "
        "of step 5 (orbax's temporary: deleted when a later start opens the checkpoints, "
        "unless another live process holds the run's lock)",
        f"could not remove {tmp_path / '5'}, left by the failed save of step 5 (an incomplete "
        "step: deleted by the cleanup after the next completed save, or replaced when this "
        "step is saved again)"}


def test_metadata_never_holds_a_credential(tmp_path, mesh32, hf_dir, monkeypatch):
    env_secret = "sk-env-FAKE-0123456789abcdef"
    cfg_secret = "sk-cfg-FAKE-fedcba9876543210"
    monkeypatch.setenv("OPENAI_API_KEY", env_secret)
    config = {"judge": {"api_key": cfg_secret, "base_url": f"https://judge/?key={env_secret}",
                        "model": "qwen-judge"}, "sampling": {"max_new_tokens": 64}}
    meta = training_metadata(config=config, protocol_hash="p" * 8, schedule_hash="s" * 8,
                             optimizer_step=3, effective_updates=2, judge={"kind": "served"})
    store = CheckpointStore(tmp_path)
    params, mu, nu = logical_values(0)
    store.save(1, params=params, adam={"count": 3, "mu": mu, "nu": nu},
               train_state={"update": 1},
               metadata=dict(meta, extra={"hf_token": "hf_FAKEFAKEFAKE"}), hf_assets_dir=hf_dir,
               shapes=SHAPES)
    written = [p for p in store.step_path(1).rglob("*") if p.is_file()]
    assert len(written) > 10
    for p in written:
        data = p.read_bytes()
        for secret in (env_secret, cfg_secret, "hf_FAKEFAKEFAKE"):
            assert secret.encode() not in data, f"{secret} leaked into {p}"
    got = store.restore(1).metadata
    assert got["config"]["judge"]["api_key"] == "<redacted>"
    assert got["config"]["judge"]["base_url"] == "<redacted>"
    assert got["config"]["judge"]["model"] == "qwen-judge"
    assert got["config"]["sampling"]["max_new_tokens"] == 64
    assert got["extra"]["hf_token"] == "<redacted>"
    assert (got["protocol_hash"], got["schedule_hash"], got["optimizer_step"]) == ("p" * 8, "s" * 8, 3)


# The child saves step 1, then hangs inside the save of step 2 at a chosen point and is
# SIGKILLed there: "orbax" = arrays written, orbax's rename to the final directory not done;
# "checksums" = orbax finalised, hf/ and metadata written, checksums.json not yet.
_CHILD = textwrap.dedent("""
    import sys, time
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    import test_checkpoint as t
    from jscenegen.checkpoint import store as checkpoint
    from jscenegen.checkpoint.store import CheckpointStore
    run_dir, where = sys.argv[1], sys.argv[2]
    mesh = jax.make_mesh((3, 2), ("fsdp", "sp"))
    store = CheckpointStore(run_dir, keep_last=1)
    t.save_step(store, 1, mesh, sys.argv[3], seed=1)
    def hang(*a, **k):
        print("HANGING", flush=True)
        time.sleep(600)
    if where == "orbax":
        from orbax.checkpoint._src.path import atomicity
        async def finalize(self, *a, **k):
            hang()
        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    else:
        checkpoint.write_checksums = hang
    t.save_step(store, 2, mesh, sys.argv[3], seed=2)
    print("NOT KILLED", flush=True)
""")


@pytest.mark.parametrize("where", ["orbax", "checksums"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, mesh32, hf_dir, where):
    run_dir = tmp_path / "checkpoints"
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="6", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    script = _CHILD.format(tests=str(Path(__file__).parent))
    child = subprocess.Popen([sys.executable, "-c", script, str(run_dir), where, str(hf_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(180, child.kill)  # a child that never hangs ends the test, not CI
    watchdog.start()
    try:
        line = ""
        while line != "HANGING\n":
            line = child.stdout.readline()
            assert line, f"child ended early: {child.stderr.read()[-3000:]}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        watchdog.cancel()
        child.kill()
        child.wait()
    step2 = run_dir / "2"
    if where == "orbax":
        assert not step2.exists() and list(run_dir.glob("2.orbax-checkpoint-tmp*"))
    else:
        assert (step2 / "training_metadata.json").exists() and not (step2 / "checksums.json").exists()
    store = CheckpointStore(run_dir, keep_last=1)
    assert store.latest_valid_step() == 1
    assert not list(run_dir.glob("*orbax-checkpoint-tmp*"))  # orbax cleaned the unfinished write
    if where == "checksums":
        status = store.scan()[0]
        assert status.step == 2 and not status.valid and "checksums.json: missing" in status.reason
    ck = store.restore(target=padded_target(SHAPES, mesh32))
    params, mu, _ = logical_values(1)
    assert ck.step == 1 and int(ck.adam["count"]) == 1
    np.testing.assert_array_equal(np.asarray(ck.params["model.embed_tokens.weight"])[:13],
                                  params["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(ck.adam["mu"]["lm_head.weight"])[:13], mu["lm_head.weight"])
    # The broken step is replaced by the next save of that number; keep_last=1 then drops step 1.
    save_step(store, 2, mesh32, hf_dir, seed=2)
    assert store.steps() == [2] and store.latest_valid_step() == 2


def test_lazy_arrays_are_written_one_at_a_time_and_restore_bitwise(tmp_path, hf_dir):
    """LazyArray leaves (what converters pass) are loaded only while orbax writes them, one at a
    time, and read back as the same bits as plain arrays."""
    import weakref

    from jscenegen.checkpoint.lazy_array import LazyArray

    params, mu, nu = logical_values(11)
    alive, peak = set(), [0]

    def tracked(arr, key):
        def load():
            out = arr.copy()
            alive.add(key)
            peak[0] = max(peak[0], len(alive))
            weakref.finalize(out, alive.discard, key)
            return out
        return LazyArray(arr.shape, arr.dtype, load, key)

    lazy = {g: {n: tracked(x, f"{g}/{n}") for n, x in arrays.items()}
            for g, arrays in (("params", params), ("mu", mu), ("nu", nu))}
    with CheckpointStore(tmp_path / "ckpt") as store:
        store.save(3, params=lazy["params"], adam={"count": np.int32(3), "mu": lazy["mu"], "nu": lazy["nu"]},
                   train_state=TRAIN_STATE, metadata=meta(3), hf_assets_dir=hf_dir, shapes=SHAPES)
        got = store.restore(3)
    assert peak[0] == 1 and not alive
    for name in SHAPES:
        np.testing.assert_array_equal(got.params[name], params[name])
        np.testing.assert_array_equal(got.adam["mu"][name], mu[name])
        np.testing.assert_array_equal(got.adam["nu"][name], nu[name])


def test_lazy_array_with_a_wrong_loader_is_refused_naming_it(tmp_path, hf_dir):
    from jscenegen.checkpoint.lazy_array import LazyArray

    params, mu, nu = logical_values(12)
    name = next(iter(SHAPES))
    bad = dict(params, **{name: LazyArray(params[name].shape, np.float32,
                                          lambda: params[name].astype(np.float64), name)})
    with CheckpointStore(tmp_path / "ckpt") as store, pytest.raises(Exception, match=name):
        store.save(1, params=bad, adam={"count": np.int32(1), "mu": mu, "nu": nu},
                   train_state=TRAIN_STATE, metadata=meta(1), hf_assets_dir=hf_dir, shapes=SHAPES)
    assert not (tmp_path / "ckpt" / "1").exists() or not check_step(tmp_path / "ckpt" / "1").valid


# ---- frozen (carried) tensors: params/ holds every tensor, adam/ only the trainable ones ----
FROZEN = {"model.visual.blocks.0.attn.qkv.weight": (5, 3), "mtp.fc.weight": (7, 2)}


def frozen_values(seed):
    """Carried tensors as a Qwen3.5 release stores them: bf16, odd dim 0 (padded on 6)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in FROZEN.items()}


@pytest.fixture(scope="module")
def saved_with_frozen(tmp_path_factory, mesh32, hf_dir):
    """Step 4 from the 3 x 2 mesh: trainable fp32 params + moments, frozen bf16 tensors."""
    import ml_dtypes

    store = CheckpointStore(tmp_path_factory.mktemp("frozen") / "checkpoints")
    params, mu, nu = logical_values(4)
    frozen = frozen_values(4)
    shapes = dict(SHAPES, **FROZEN)
    placed = padded_on(mesh32, frozen, shapes, ml_dtypes.bfloat16)
    store.save(4, params=dict(padded_on(mesh32, params), **placed),
               adam={"count": np.int32(4), "mu": padded_on(mesh32, mu), "nu": padded_on(mesh32, nu)},
               train_state=TRAIN_STATE, metadata=meta(4), hf_assets_dir=hf_dir, shapes=shapes,
               trainable=list(SHAPES))
    return store, (params, mu, nu, frozen)


def test_frozen_tensors_are_stored_bitwise_without_adam_state(saved_with_frozen):
    store, (params, mu, nu, frozen) = saved_with_frozen
    path = store.step_path(4)
    stored = array_shapes(path, "params")
    assert set(stored) == set(SHAPES) | set(FROZEN)
    assert all(str(stored[n][1]) == "bfloat16" and stored[n][0] == s for n, s in FROZEN.items())
    assert set(array_shapes(path, "mu")) == set(array_shapes(path, "nu")) == set(SHAPES)
    assert json.loads((path / "training_metadata.json").read_text())["frozen_tensors"] == list(FROZEN)
    ck = store.restore(4)  # NumPy, logical shapes, stored dtypes
    assert ck.frozen == tuple(sorted(FROZEN)) and set(ck.adam["mu"]) == set(SHAPES)
    for n, x in frozen.items():
        assert ck.params[n].dtype == x.dtype
        np.testing.assert_array_equal(ck.params[n].view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize("mesh_shape", [(3, 2), (1, 2)])
def test_frozen_tensors_restore_in_their_dtype_placed_like_parameters(saved_with_frozen, mesh_shape):
    store, (params, mu, _, frozen) = saved_with_frozen
    n_dev = mesh_shape[0] * mesh_shape[1]
    mesh = jax.make_mesh(mesh_shape, ("fsdp", "sp"), devices=jax.devices()[:n_dev])
    target = padded_target(dict(SHAPES, **FROZEN), mesh)  # fp32 target: frozen ones are not cast
    ck = store.restore(4, target=target)
    for n, x in frozen.items():
        got = ck.params[n]
        assert got.dtype == x.dtype and got.shape == target[n].shape
        assert got.shape[0] % n_dev == 0 and got.sharding == NamedSharding(mesh, P(("fsdp", "sp")))
        host = np.asarray(got)
        np.testing.assert_array_equal(host[: x.shape[0]].view(np.uint16), x.view(np.uint16))
        assert not host[x.shape[0]:].astype(np.float32).any()
    assert ck.params["lm_head.weight"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(ck.adam["mu"]["lm_head.weight"])[:13], mu["lm_head.weight"])
    assert set(ck.adam["nu"]) == set(SHAPES)


def test_adam_state_must_cover_exactly_the_trainable_tensors(tmp_path, hf_dir):
    store = CheckpointStore(tmp_path / "checkpoints")
    params, mu, nu = logical_values(0)
    frozen = frozen_values(0)
    shapes = dict(SHAPES, **FROZEN)
    good = dict(params=dict(params, **frozen), adam={"count": np.int32(1), "mu": mu, "nu": nu},
                train_state={}, metadata=meta(1), hf_assets_dir=hf_dir, shapes=shapes,
                trainable=list(SHAPES))
    fp32 = {n: x.astype(np.float32) for n, x in frozen.items()}
    with pytest.raises(CheckpointError, match=r"adam\['mu'\]: names differ from the trainable "
                       r"tensors.*unexpected \['model\.visual"):
        store.save(1, **dict(good, adam={"count": 1, "mu": dict(mu, **fp32), "nu": nu}))
    with pytest.raises(CheckpointError, match=r"adam\['nu'\].*missing \['model\.visual"):
        store.save(1, **dict(good, adam={"count": 1, "mu": dict(mu, **fp32), "nu": nu},
                             trainable=list(shapes)))
    with pytest.raises(CheckpointError, match=r"trainable names \['extra'\] are not in shapes"):
        store.save(1, **dict(good, trainable=[*SHAPES, "extra"]))
    assert store.steps() == []


def test_resume_refuses_adam_state_for_other_tensors(saved_with_frozen, mesh32, monkeypatch):
    from jscenegen.checkpoint.resume import restore_onto_mesh

    store, _ = saved_with_frozen
    shapes = dict(SHAPES, **FROZEN)
    ck = restore_onto_mesh(store, shapes, mesh32, np.float32, trainable=list(SHAPES))
    assert ck.step == 4

    def no_arrays(*args, **kwargs):
        raise AssertionError("the arrays were read before the refusal")

    # refused from orbax's metadata: a refusal of a multi-GB step reads none of its arrays
    monkeypatch.setattr(CheckpointStore, "_restore_items", no_arrays)
    with pytest.raises(CheckpointError, match=r"none for 2 it trains .*model\.train_vision"):
        restore_onto_mesh(store, shapes, mesh32, np.float32, trainable=list(shapes))


def test_a_resume_hashes_each_file_of_the_step_it_restores_once(saved_with_frozen, mesh32,
                                                                 monkeypatch):
    """The set-aside, the newest-step search and the restore each hashed the whole step: three
    full reads of a 90 GB checkpoint per process before orbax read it."""
    import collections

    import jscenegen.checkpoint.checksums as checksums
    from jscenegen.checkpoint.resume import restore_onto_mesh

    store, _ = saved_with_frozen
    hashed = collections.Counter()
    real = checksums.file_sha256

    def counting(path):
        hashed[str(path)] += 1
        return real(path)

    monkeypatch.setattr(checksums, "file_sha256", counting)
    ck = restore_onto_mesh(store, dict(SHAPES, **FROZEN), mesh32, np.float32, trainable=list(SHAPES))
    assert ck.step == 4 and hashed and set(hashed.values()) == {1}, hashed


def test_a_resume_names_a_corrupt_newest_step_once(tmp_path, mesh32, hf_dir, caplog):
    """A run without a model directory (convert --to orbax) takes its assets from the newest
    complete step: that search and the restore's set-aside each warned about the same step."""
    from jscenegen.checkpoint.resume import restore_onto_mesh, resume_model_dir

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    save_step(store, 1, mesh32, hf_dir, seed=1)
    save_step(store, 2, mesh32, hf_dir, seed=2)
    victim = max((p for p in (store.step_path(2) / "adam").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    _corrupt(victim, offset=victim.stat().st_size // 2)
    with caplog.at_level("WARNING"):
        assert resume_model_dir(tmp_path) == tmp_path / "hf_assets"
        assert restore_onto_mesh(store, SHAPES, mesh32, np.float32).step == 1
    said = [m for m in caplog.messages if "step 2" in m]
    assert len(said) == 1 and "is corrupt" in said[0] and "set aside" in said[0], said
    store.close()


def test_a_damaged_copy_of_the_runs_assets_is_named_with_the_cure(tmp_path, mesh32, hf_dir):
    """RUN/hf_assets (a resume's copy of a step's hf/ assets) is verified on every resume: a
    damaged copy failed later, in the tokenizer or config reader, without saying it can go."""
    import shutil

    from jscenegen.checkpoint.resume import resume_model_dir
    from jscenegen.checkpoint.store import CheckpointError

    with CheckpointStore(tmp_path / "checkpoints") as store:
        save_step(store, 1, mesh32, hf_dir, seed=1)
    assets = resume_model_dir(tmp_path)
    step_hf = tmp_path / "checkpoints" / "1" / "hf"
    assert (assets / "config.json").read_bytes() == (step_hf / "config.json").read_bytes()
    umask = os.umask(0)
    os.umask(umask)   # the copy is published as mkdir() makes a directory (it was 0700)
    assert assets.stat().st_mode & 0o777 == 0o777 & ~umask
    (assets / "tokenizer.json").write_text("{ damaged")
    cure = rf"\({assets} is the run's copy of a checkpoint's hf/ assets: delete it, and the resume"
    with pytest.raises(CheckpointError, match=rf"^{assets}/tokenizer.json: .*\({assets}/checksums.json; 1 file fails\) {cure}"):
        resume_model_dir(tmp_path)
    (assets / "tokenizer.json").unlink()
    (assets / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"config.json: missing; {assets}/tokenizer.json: missing "
                       rf"\({assets}/checksums.json; 2 files fail\) {cure}"):
        resume_model_dir(tmp_path)
    shutil.rmtree(assets)
    assert resume_model_dir(tmp_path) == assets and (assets / "tokenizer.json").read_text() == "{}"
    # the run's record names its copy (relative), verified too; an absolute path in a copied
    # run's record names the other run's copy: never followed
    (tmp_path / "run.json").write_text('{"model_dir": "hf_assets", "config_source": "c.yaml"}')
    (assets / "tokenizer.json").write_text("{ damaged")
    with pytest.raises(CheckpointError, match=cure):
        resume_model_dir(tmp_path)
    other = tmp_path / "other_run"
    shutil.copytree(tmp_path / "checkpoints", other / "checkpoints")
    (other / "run.json").write_text(json.dumps({"model_dir": str(assets), "config_source": "c.yaml"}))
    assert resume_model_dir(other) == other / "hf_assets"


@pytest.mark.parametrize("text", ["{}", '{"model_dir": "/x', "[1]"])
def test_a_damaged_run_json_is_named(tmp_path, text):
    from jscenegen.checkpoint.resume import resume_model_dir
    from jscenegen.checkpoint.store import CheckpointError

    (tmp_path / "run.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'run.json'}: not the run's record"):
        resume_model_dir(tmp_path)


def test_a_store_removes_an_unfinished_save_that_is_a_file(tmp_path):
    """rmtree raised NotADirectoryError on a file named like orbax's temporary, after the
    warning that it was being deleted."""
    from jscenegen.checkpoint.store import CheckpointStore

    (tmp_path / "1.orbax-checkpoint-tmp").write_text("x")
    (tmp_path / "2.orbax-checkpoint-tmp-1733300000").mkdir()
    CheckpointStore(tmp_path).close()
    assert list(tmp_path.iterdir()) == []


def test_finished_saves_are_what_a_fresh_start_must_not_overwrite(tmp_path):
    from jscenegen.checkpoint.store import finished_saves

    for name in ("1.orbax-checkpoint-tmp-1", "2", "3", "3.corrupt-20261204T120000Z", "x"):
        (tmp_path / name).mkdir()
    (tmp_path / "3" / "checksums.json").write_text("{}")
    (tmp_path / ".DS_Store").write_text("")
    assert [p.name for p in finished_saves(tmp_path)] == ["3", "3.corrupt-20261204T120000Z"]
    assert finished_saves(tmp_path / "missing") == []


def test_step_numbers_are_ascii_digit_names_only(tmp_path):
    """A directory named '\u00b3' passed str.isdigit and int() raised on it."""
    from jscenegen.checkpoint.store import step_numbers

    for name in ("2", "10", "\u00b3", "\u0663", "07x", "tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "5").write_text("a file, not a step")
    assert step_numbers(tmp_path) == [2, 10]
    assert step_numbers(tmp_path / "missing") == []


def _small_step(directory, hf_dir):
    """Step 1 of a store in `directory` holding params a (4, 3) and b (5,), with their moments."""
    shapes = {"a": (4, 3), "b": (5,)}
    arrays = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) for n, s in shapes.items()}
    with CheckpointStore(directory) as store:
        store.save(1, params=arrays, adam={"count": np.int32(1), "mu": arrays, "nu": arrays},
                   train_state={"x": 1}, metadata=meta(1), hf_assets_dir=hf_dir, shapes=shapes)
    return Path(directory) / "1"


def _replace_adam(step_dir, adam):
    """Write `adam` as the step's adam/ item and the step's checksums again: a malformed item
    that verifies (another program wrote it)."""
    import shutil

    import orbax.checkpoint as ocp

    from jscenegen.checkpoint.checksums import CHECKSUMS_NAME, write_checksums

    new = step_dir.parent / "adam_new"
    handler = ocp.PyTreeCheckpointHandler()
    ocp.Checkpointer(handler).save(new, args=ocp.args.PyTreeSave(adam))
    handler.close()
    shutil.rmtree(step_dir / "adam")
    shutil.move(new, step_dir / "adam")
    (step_dir / CHECKSUMS_NAME).unlink()
    write_checksums(step_dir)


@pytest.mark.parametrize("change,message", [
    # orbax padded/truncated a moment to its parameter's target shape: a zero column, no error
    (lambda mu, nu: mu.update(a=np.full((4, 2), 2, np.float32)),
     r"adam: mu\['a'\] has shape \(4, 2\); its parameter params/\['a'\] has \(4, 3\)$"),
    (lambda mu, nu: nu.update(b=np.ones(7, np.float32)),
     r"adam: nu\['b'\] has shape \(7,\); its parameter params/\['b'\] has \(5,\)$"),
    (lambda mu, nu: nu.pop("b"),
     r"adam: mu and nu name different tensors \(only in mu: \['b'\], only in nu: \[\]\)$"),
    (lambda mu, nu: (mu.update(c=np.ones(2, np.float32)), nu.update(c=np.ones(2, np.float32))),
     r"adam: moments for \['c'\], which params/ does not store$"),
])
def test_adam_moments_must_name_and_fit_their_parameters(tmp_path, mesh32, hf_dir, change, message):
    step = _small_step(tmp_path / "checkpoints", hf_dir)
    mu = {n: np.asarray(a) for n, a in iter_arrays(step, "mu")}
    nu = {n: np.asarray(a) for n, a in iter_arrays(step, "nu")}
    change(mu, nu)
    _replace_adam(step, {"count": np.int32(1), "mu": mu, "nu": nu})
    assert check_step(step).valid   # the checksums verify: only the shapes can tell
    store = CheckpointStore(tmp_path / "checkpoints")
    where = re.escape(str(step))
    with pytest.raises(CheckpointError, match=rf"^{where}/{message}"):
        store.restore(target=padded_target({"a": (4, 3), "b": (5,)}, mesh32))
    with pytest.raises(CheckpointError, match=rf"^{where}/{message}"):
        store.restore()
    store.close()


def test_an_adam_item_without_moments_is_one_named_error(tmp_path, hf_dir):
    """`tree["mu"]` raised KeyError, outside the store's orbax error handling."""
    step = _small_step(tmp_path / "checkpoints", hf_dir)
    nu = {n: np.asarray(a) for n, a in iter_arrays(step, "nu")}
    _replace_adam(step, {"count": np.int32(1), "nu": nu})
    with CheckpointStore(tmp_path / "checkpoints") as store:
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(step / 'adam'))}: no mu "
                                                  r"\(Adam's moments as \{name: array\}\); the item "
                                                  r"holds \['count', 'nu'\]$"):
            store.restore()
    with pytest.raises(CheckpointError, match=r"adam: no mu"):
        array_shapes(step, "mu")


def test_an_adam_count_beyond_int32_is_refused_naming_the_limit(tmp_path, hf_dir):
    """np.asarray(2**31, np.int32) raised OverflowError, which no caller reports as bad input."""
    params, mu, nu = logical_values(0)
    store = CheckpointStore(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=r"adam\['count'\] is 2147483648; the checkpoint "
                                              r"stores it as int32 \(optax's count\), at most "
                                              r"2147483647$"):
        store.save(1, params=params, adam={"count": np.int64(2 ** 31), "mu": mu, "nu": nu},
                   train_state={}, metadata=meta(2 ** 31), hf_assets_dir=hf_dir, shapes=SHAPES)
    assert store.steps() == []
    store.close()


def test_iter_arrays_with_an_empty_name_list_yields_nothing(tmp_path, hf_dir):
    step = _small_step(tmp_path / "checkpoints", hf_dir)
    assert list(iter_arrays(step, "params", names=[])) == []
    assert [n for n, _ in iter_arrays(step, "params", names=["b"])] == ["b"]
    assert [n for n, _ in iter_arrays(step, "params")] == ["a", "b"]
