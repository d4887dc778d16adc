"""verl <-> orbax <-> hf (convert/orbax_directions.py) on torch FSDP2 fixtures.

- verl -> orbax -> verl is bitwise for every tensor, moment, step, scheduler state and RNG state;
- the orbax checkpoint restores through jscenegen's CheckpointStore with the torch values;
- one more AdamW step in torch and in jscenegen (jscenegen.grpo.algo.optimizer) from the same VERL
  state and the same gradient agree to <= 1e-7 (one fp32 ulp, 1.19e-7, on weights >= 1);
- hf -> orbax -> hf is bitwise, with fresh Adam state.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.orbax_directions import hf_to_orbax, orbax_to_hf, orbax_to_verl, verl_to_orbax
from convert.verl_read import VerlCheckpoint
from jscenegen.checkpoint.checksums import verify_checksums

from fsdp_fixtures import fixture_dir


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The Shard(1) fixture converted to orbax once."""
    src = fixture_dir("qwen2_first_divisible")
    dst = tmp_path_factory.mktemp("orbax") / "run"
    step_dir = verl_to_orbax(src / "ckpt", dst)
    return {"src": src, "run": dst, "step": step_dir,
            "params": load_file(str(src / "reference/params.safetensors")),
            "optim": load_file(str(src / "reference/optim.safetensors"))}


def test_verl_to_orbax_restores_torch_values(converted):
    from jscenegen.checkpoint.store import CheckpointStore

    assert converted["step"].name == "3"
    assert verify_checksums(converted["run"]) > 0
    with CheckpointStore(converted["run"]) as store:
        ck = store.restore()
    assert ck.step == 3 and int(ck.adam["count"]) == 3
    for name, a in ck.params.items():
        np.testing.assert_array_equal(a, converted["params"][name], err_msg=name)
        np.testing.assert_array_equal(ck.adam["mu"][name], converted["optim"][f"{name}.exp_avg"])
        np.testing.assert_array_equal(ck.adam["nu"][name], converted["optim"][f"{name}.exp_avg_sq"])
    assert ck.train_state["step"] == 3 and ck.train_state["lr_schedule_count"] == 3
    src = ck.metadata["source"]
    assert src["format"] == "verl" and src["world_size"] == 6 and ck.metadata["optimizer_step"] == 3
    assert src["shard_dims"]["model.embed_tokens.weight"] == 1
    assert len(src["verl"]["extra_state"]) == 6 and src["verl"]["param_groups"][0]["lr"] == 1e-3
    layout = json.loads((converted["run"] / "checkpoint-layout.json").read_text())
    assert layout["source_format"] == "verl" and layout["step"] == 3


def test_a_trained_verl_step_saved_without_its_optimizer_says_adam_starts_afresh(tmp_path):
    """VERL saves the model alone when `save_contents` leaves out "optimizer": the conversion
    gave zero moments without a word, and its metadata did not say so."""
    import shutil

    from convert.errors import ConversionWarning
    from jscenegen.checkpoint.store import CheckpointStore

    src = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("qwen2_first_divisible") / "ckpt", src)
    for f in (src / "global_step_3" / "actor").glob("optim_world_size_6_rank_*.pt"):
        f.unlink()
    with pytest.warns(ConversionWarning, match=r"global_step_3/actor: no optim_world_size_6_rank_\*\.pt "
                      r"files \(the model was saved without its optimizer\): Adam starts afresh"):
        verl_to_orbax(src, tmp_path / "run")
    with CheckpointStore(tmp_path / "run") as store:
        ck = store.restore()
    assert ck.step == 3 and int(ck.adam["count"]) == 0
    assert not any(np.any(m) for m in ck.adam["mu"].values())
    assert ck.metadata["source"]["adam"] == "fresh: no optim rank files"


def test_verl_orbax_verl_is_bitwise(converted, tmp_path):
    import torch

    out = tmp_path / "back"
    orbax_to_verl(converted["run"], out, world_size=6, placement="first-divisible",
                  device_type="cpu")
    a, b = VerlCheckpoint(converted["src"] / "ckpt"), VerlCheckpoint(out)
    assert b.layout.global_step == 3 and b.world_size == 6
    assert {k: v.shard_dim for k, v in a.tensor_info().items()} == \
        {k: v.shard_dim for k, v in b.tensor_info().items()}
    for (n1, x1), (n2, x2) in zip(a.iter_params(include_tied_alias=True),
                                  b.iter_params(include_tied_alias=True)):
        assert n1 == n2
        np.testing.assert_array_equal(x1, x2, err_msg=n1)
    for (n1, m1, v1), (_, m2, v2) in zip(a.iter_adam(), b.iter_adam()):
        np.testing.assert_array_equal(m1, m2, err_msg=n1)
        np.testing.assert_array_equal(v1, v2, err_msg=n1)
    assert a.adam_step() == b.adam_step() == 3
    assert a.param_groups() == b.param_groups()
    for ea, eb in zip(a.extra_states(), b.extra_states()):
        assert ea["lr_scheduler"] == eb["lr_scheduler"]
        assert torch.equal(ea["rng"]["cpu"], eb["rng"]["cpu"])
        assert ea["rng"]["random"] == eb["rng"]["random"]
        assert ea["rng"]["numpy"][0] == eb["rng"]["numpy"][0]
        np.testing.assert_array_equal(ea["rng"]["numpy"][1], eb["rng"]["numpy"][1])
        assert ea["rng"]["numpy"][2:] == eb["rng"]["numpy"][2:]


def test_one_more_adamw_step_matches_torch(converted):
    """Same VERL state, same gradient: torch.optim.AdamW (+ clip_grad_norm_) vs jscenegen."""
    import jax.numpy as jnp
    import torch

    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.grpo.algo.config import OptimConfig
    from jscenegen.grpo.algo.optimizer import make_optimizer, optimizer_step, state_from_canonical

    ck_verl = VerlCheckpoint(converted["src"] / "ckpt")
    names = ck_verl.param_order
    rng = np.random.default_rng(7)
    grads = {n: rng.standard_normal(converted["params"][n].shape).astype(np.float32) * 0.1
             for n in names}
    # torch: the VERL optimizer state loaded into a plain (unsharded) AdamW
    params_t = [torch.nn.Parameter(torch.from_numpy(converted["params"][n].copy())) for n in names]
    opt = torch.optim.AdamW(params_t, lr=1e-3)
    opt.load_state_dict({"state": {i: {"step": torch.tensor(3.0),
                                       "exp_avg": torch.from_numpy(m.copy()),
                                       "exp_avg_sq": torch.from_numpy(v.copy())}
                                   for i, (_, m, v) in enumerate(ck_verl.iter_adam())},
                         "param_groups": ck_verl.param_groups()})
    for p, n in zip(params_t, names):
        p.grad = torch.from_numpy(grads[n].copy())
    torch.nn.utils.clip_grad_norm_(params_t, 1.0)
    opt.step()
    # jscenegen: the orbax checkpoint restored, then one optimizer_step
    with CheckpointStore(converted["run"]) as store:
        ck = store.restore()
    group = ck.metadata["source"]["verl"]["param_groups"][0]
    cfg = OptimConfig(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                      weight_decay=group["weight_decay"], grad_clip=1.0)
    tx = make_optimizer(cfg)
    params = {n: jnp.asarray(ck.params[n]) for n in names}
    state = state_from_canonical({"count": int(ck.adam["count"]), "mu": ck.adam["mu"],
                                  "nu": ck.adam["nu"]}, tx.init(params))
    new_params, new_state, _, skipped = optimizer_step(
        tx, {n: jnp.asarray(g) for n, g in grads.items()}, state, params,
        learning_rate=group["lr"])
    assert not bool(skipped)
    for p, n in zip(params_t, names):
        want = p.detach().numpy()
        got = np.asarray(new_params[n])
        assert not np.array_equal(got, converted["params"][n])  # it moved
        # <= 1e-7, or one fp32 ulp for weights >= 1 (1.19e-7): the optimizer's rounding, since
        # the converted state itself is bitwise (test_verl_orbax_verl_is_bitwise)
        tol = np.maximum(1e-7, np.spacing(np.abs(want)))
        assert (np.abs(got - want) <= tol).all(), (n, float(np.abs(got - want).max()))


def test_hf_orbax_hf_is_bitwise(tmp_path):
    from convert.directions import verl_to_hf
    from jscenegen.checkpoint.store import CheckpointStore

    src = tmp_path / "hf_src"  # tied qwen3 with a tokenizer, as VERL's huggingface/ carries one
    verl_to_hf(fixture_dir("qwen3_tied_dim0") / "ckpt", src)
    ref = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in ref
    step_dir = hf_to_orbax(src, tmp_path / "run")
    assert step_dir.name == "0"
    with CheckpointStore(tmp_path / "run") as store:
        ck = store.restore()
    assert int(ck.adam["count"]) == 0 and ck.metadata["source"]["format"] == "hf"
    assert all(not ck.adam["mu"][n].any() and not ck.adam["nu"][n].any() for n in ck.params)
    orbax_to_hf(tmp_path / "run", tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    assert verify_checksums(tmp_path / "hf") > 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    # --dtype: config.json names the dtype written (transformers loads the weights in it)
    orbax_to_hf(tmp_path / "run", tmp_path / "hf16", dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_hf_to_orbax_without_tokenizer_is_refused(tiny_hf, tmp_path):
    from convert.errors import ConvertError

    with pytest.raises(ConvertError, match="no tokenizer"):
        hf_to_orbax(tiny_hf["qwen2"], tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- Qwen3.5: vision tower, mtp.*, frozen tensors
QWEN35 = ("qwen35_first_divisible", "qwen35_tied_frozen_dim0")


@pytest.fixture(scope="module", params=QWEN35)
def converted35(request, tmp_path_factory):
    """A Qwen3.5 VLM fixture converted to orbax once, mtp.* taken from its release."""
    src = fixture_dir(request.param)
    dst = tmp_path_factory.mktemp("orbax35") / "run"
    verl_to_orbax(src / "ckpt", dst, carried_from=src / "release")
    meta = json.loads((src / "reference/meta.json").read_text())
    return {"src": src, "run": dst, "name": request.param, "meta": meta,
            "params": load_file(str(src / "reference/params.safetensors")),
            "optim": load_file(str(src / "reference/optim.safetensors"))}


def _release(src):
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files

    return {n: read_tensor(f, n) for n, f in safetensors_files(src / "release").items()}


def test_qwen35_verl_to_orbax_holds_every_tensor(converted35):
    """params/: every tensor (tower and text as torch held them, mtp.* from the release in
    bf16); adam/: exactly the tensors torch kept state for; frozen ones listed."""
    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.model.config import QwenConfig

    with CheckpointStore(converted35["run"]) as store:
        ck = store.restore()
    ref, release, meta = converted35["params"], _release(converted35["src"]), converted35["meta"]
    trained = [meta["param_order"][i] for i in meta["state_indices"]]
    assert set(ck.params) == set(meta["param_order"]) | {n for n in release if n.startswith("mtp.")}
    for name, a in ck.params.items():
        if name.startswith("mtp."):
            assert a.dtype == release[name].dtype and str(a.dtype) == "bfloat16"
            np.testing.assert_array_equal(a.view(np.uint16), release[name].view(np.uint16))
        else:
            assert a.dtype == np.float32
            np.testing.assert_array_equal(a, ref[name], err_msg=name)
    assert sorted(ck.adam["mu"]) == sorted(ck.adam["nu"]) == sorted(trained)
    for name in trained:
        np.testing.assert_array_equal(ck.adam["mu"][name], converted35["optim"][f"{name}.exp_avg"])
        np.testing.assert_array_equal(ck.adam["nu"][name], converted35["optim"][f"{name}.exp_avg_sq"])
    assert set(ck.frozen) == set(meta["frozen"]) | {n for n in release if n.startswith("mtp.")}
    assert sorted(ck.metadata["frozen_tensors"]) == sorted(ck.frozen)
    assert ck.metadata["source"]["no_adam_state"] == meta["frozen"]
    assert int(ck.adam["count"]) == 3 and ck.train_state["lr_schedule_count"] == 3
    hf = QwenConfig.from_dir(ck.path / "hf")  # the config a resumed run builds its model from
    assert hf.mtp_layers == 1 and (ck.path / "hf/preprocessor_config.json").is_file()


def test_qwen35_resumes_onto_the_mesh(converted35):
    """What the trainer does on resume: every tensor onto the 3 x 2 mesh (frozen ones in
    their stored dtype), Adam for exactly the tensors a run with the matching
    `model.train_vision` trains; the other setting is refused."""
    import jax

    from jscenegen.checkpoint.resume import restore_onto_mesh
    from jscenegen.checkpoint.store import CheckpointError, CheckpointStore
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.weights import param_shapes
    from jscenegen.sharding.mesh import make_mesh

    step = next(p for p in converted35["run"].iterdir() if p.name.isdigit())
    cfg = QwenConfig.from_dir(step / "hf")
    mesh = make_mesh(fsdp=3, sp=2)
    train_vision = not converted35["meta"]["frozen"]
    with CheckpointStore(converted35["run"]) as store:
        ck = restore_onto_mesh(store, param_shapes(cfg, carried=True), mesh, np.float32,
                               param_shapes(cfg, train_vision=train_vision))
        with pytest.raises(CheckpointError, match="train_vision"):
            restore_onto_mesh(store, param_shapes(cfg, carried=True), mesh, np.float32,
                              param_shapes(cfg, train_vision=not train_vision))
    emb = ck.params["model.language_model.embed_tokens.weight"]
    assert emb.shape[0] % 6 == 0 and len(emb.sharding.device_set) == 6
    mtp = ck.params["mtp.fc.weight"]
    assert str(mtp.dtype) == "bfloat16" and len(mtp.sharding.device_set) == 6
    got = np.asarray(jax.device_get(emb))[: converted35["params"][
        "model.language_model.embed_tokens.weight"].shape[0]]
    np.testing.assert_array_equal(got, converted35["params"]["model.language_model.embed_tokens.weight"])


def test_qwen35_verl_orbax_verl_is_bitwise(converted35, tmp_path):
    """Back to VERL at W = 6 and the source's placement: every local shard, placement, moment
    (none for the frozen tower), step, param_groups and RNG state as torch saved them."""
    import torch

    from convert.torch_safe import load_pt

    placement = converted35["meta"]["placement"]
    out = tmp_path / "back"
    orbax_to_verl(converted35["run"], out, world_size=6, placement=placement, device_type="cpu")
    layout = json.loads((out / "checkpoint-layout.json").read_text())
    assert len(layout["not_in_verl"]) == 15 and layout["no_adam_state"] == converted35["meta"]["frozen"]
    a_dir = converted35["src"] / "ckpt/global_step_3/actor"
    b_dir = out / "global_step_3/actor"
    for r in range(6):
        a, b = load_pt(a_dir / f"model_world_size_6_rank_{r}.pt"), load_pt(b_dir / f"model_world_size_6_rank_{r}.pt")
        assert list(a) == list(b)  # state_dict order: tower, text, head (tied alias last)
        for k in a:
            assert a[k].placements == b[k].placements and a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k].to_local(), b[k].to_local()), (r, k)
        oa, ob = load_pt(a_dir / f"optim_world_size_6_rank_{r}.pt"), load_pt(b_dir / f"optim_world_size_6_rank_{r}.pt")
        assert oa["param_groups"] == ob["param_groups"] and sorted(oa["state"]) == sorted(ob["state"])
        for i, st in oa["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[key].to_local(), ob["state"][i][key].to_local()), (r, i, key)
            assert torch.equal(st["step"], ob["state"][i]["step"])
        ea, eb = load_pt(a_dir / f"extra_state_world_size_6_rank_{r}.pt"), load_pt(b_dir / f"extra_state_world_size_6_rank_{r}.pt")
        assert ea["lr_scheduler"] == eb["lr_scheduler"] and torch.equal(ea["rng"]["cpu"], eb["rng"]["cpu"])
    for f in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        assert (b_dir / "huggingface" / f).read_bytes() == (a_dir / "huggingface" / f).read_bytes()


def test_qwen35_orbax_to_hf_is_verl_to_hf(converted35, tmp_path):
    """orbax -> HF gives the tensors VERL -> HF gives (mtp.* from the same release), bitwise
    and in the same dtypes, and transformers' VLM loads them."""
    import torch
    from transformers import AutoModelForImageTextToText

    from convert.directions import verl_to_hf
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files

    orbax_to_hf(converted35["run"], tmp_path / "a")
    verl_to_hf(converted35["src"] / "ckpt", tmp_path / "b", carried_from=converted35["src"] / "release")
    a = {n: read_tensor(f, n) for n, f in safetensors_files(tmp_path / "a").items()}
    b = {n: read_tensor(f, n) for n, f in safetensors_files(tmp_path / "b").items()}
    assert set(a) == set(b) and len([n for n in a if n.startswith("mtp.")]) == 15
    for n in a:
        assert a[n].dtype == b[n].dtype, n
        np.testing.assert_array_equal(a[n].view(np.uint8), b[n].view(np.uint8), err_msg=n)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "a", dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.from_numpy(converted35["params"][k])), k


def test_qwen35_without_mtp_source_the_checkpoint_says_so(tmp_path):
    """No --carried-from and no weights in huggingface/: mtp.* dropped with a warning, and the
    step's hf/config.json says mtp_num_hidden_layers 0, so a resumed run builds a model that
    fits params/."""
    from convert.errors import ConversionWarning
    from jscenegen.checkpoint.store import array_shapes
    from jscenegen.model.config import QwenConfig
    from jscenegen.model.weights import param_shapes

    src = fixture_dir("qwen35_tied_frozen_dim0")
    with pytest.warns(ConversionWarning, match="mtp"):
        step = verl_to_orbax(src / "ckpt", tmp_path / "run")
    cfg = QwenConfig.from_dir(step / "hf")
    assert cfg.mtp_layers == 0
    assert set(array_shapes(step, "params")) == set(param_shapes(cfg, carried=True))
    layout = json.loads((tmp_path / "run/checkpoint-layout.json").read_text())
    assert len(layout["dropped"]) == 15
    orbax_to_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0


def test_qwen35_release_hf_orbax_hf_is_bitwise(tmp_path):
    """The release (bf16 with fp32 A_log / gated norm, mtp.*, released shard name) -> orbax ->
    HF: every tensor in its stored dtype, bit for bit; fresh Adam for the text only."""
    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files

    rel = fixture_dir("qwen35_tied_frozen_dim0") / "release"
    release = {n: read_tensor(f, n) for n, f in safetensors_files(rel).items()}
    hf_to_orbax(rel, tmp_path / "run")
    with CheckpointStore(tmp_path / "run") as store:
        ck = store.restore()
    assert set(ck.params) == set(release)
    assert set(ck.frozen) == {n for n in release if n.startswith(("model.visual.", "mtp."))}
    assert all(not ck.adam["mu"][n].any() for n in ck.adam["mu"]) and int(ck.adam["count"]) == 0
    for n, a in release.items():
        assert ck.params[n].dtype == a.dtype, n
    orbax_to_hf(tmp_path / "run", tmp_path / "hf")
    got = {n: read_tensor(f, n) for n, f in safetensors_files(tmp_path / "hf").items()}
    assert set(got) == set(release)
    for n, a in release.items():
        assert got[n].dtype == a.dtype, n
        np.testing.assert_array_equal(got[n].view(np.uint8), a.view(np.uint8), err_msg=n)
    for f in ("config.json", "preprocessor_config.json", "video_preprocessor_config.json",
              "chat_template.jinja"):
        assert (tmp_path / "hf" / f).read_bytes() == (rel / f).read_bytes(), f


def test_qwen35_transformers_dir_to_orbax_is_consistent(tmp_path):
    """A directory transformers saved (no mtp.*, config still says 1 MTP layer): the
    checkpoint's hf/config.json says 0, so readers of hf/ alone expect what params/ holds."""
    from transformers import AutoModelForImageTextToText

    from jscenegen.model.assets import copy_assets
    from jscenegen.model.config import QwenConfig

    rel = fixture_dir("qwen35_tied_frozen_dim0") / "release"
    saved = tmp_path / "saved"
    AutoModelForImageTextToText.from_pretrained(rel).save_pretrained(saved)
    copy_assets(rel, saved, skip=("config.json",))
    assert json.loads((saved / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    step = hf_to_orbax(saved, tmp_path / "run")
    assert QwenConfig.from_dir(step / "hf").mtp_layers == 0
    orbax_to_verl(tmp_path / "run", tmp_path / "verl", world_size=3, device_type="cpu")
    assert VerlCheckpoint(tmp_path / "verl").frozen == [
        n for n in VerlCheckpoint(tmp_path / "verl").param_order if n.startswith("model.visual.")]


def test_an_interrupted_orbax_write_leaves_no_partial_destination(tmp_path, monkeypatch):
    """Ctrl-C while orbax's threads write: the unfinished destination beside DST used to be
    removed while they still wrote into it (they create directories as they go), so part of it
    stayed behind, with pages of their tracebacks. The writes not begun are cancelled, the one
    in hand finished, then the destination removed."""
    import os
    import signal
    import threading
    import time

    from jscenegen.checkpoint.lazy_array import LazyArray

    loaded = []
    materialize = LazyArray.materialize

    def slow_materialize(self):
        loaded.append(self.name)
        if len(loaded) == 2:   # Ctrl-C while this array is in hand, then finish writing it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        return materialize(self)

    monkeypatch.setattr(LazyArray, "materialize", slow_materialize)
    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        verl_to_orbax(fixture_dir("qwen2_first_divisible") / "ckpt", tmp_path / "run")
        time.sleep(10)   # (not reached: the interrupt ends the save)
    for t in set(threading.enumerate()) - before:  # anything still writing would leave files
        if not t.daemon:
            threading.Thread.join(t, 10)
    assert os.listdir(tmp_path) == []
    assert 2 <= len(loaded) <= 3        # the model's other arrays were never loaded


def test_a_run_directory_without_a_complete_step_says_why_its_newest_is_not(converted, tmp_path):
    import shutil

    from convert.errors import ConvertError
    from convert.orbax_directions import orbax_step_dir

    run = tmp_path / "run"
    shutil.copytree(converted["run"], run)
    shutil.rmtree(run / "3" / "adam")
    with pytest.raises(ConvertError, match=rf"^{run}: no complete orbax checkpoint step here; "
                                           r"the newest, step 3: .*adam"):
        orbax_step_dir(run)
    with pytest.raises(ConvertError, match=r"\(no numbered step directory\)"):
        orbax_step_dir(tmp_path)
    shutil.rmtree(run / "3" / "params")   # the step itself, named: what it lacks, not "no step"
    with pytest.raises(ConvertError, match=rf"^{run / '3'}: not a complete checkpoint \({run / '3'}: "
                                           r"missing params, adam\)$"):
        orbax_step_dir(run / "3")


@pytest.mark.parametrize("keep_verl_state", [False, True])
@pytest.mark.parametrize("optim", [
    {"lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 5, "total_steps": None,
     "min_lr_ratio": 0.0, "num_cycles": 0.5},
    {"lr": 1e-3, "lr_schedule": "cosine", "warmup_steps": 2, "total_steps": 10,
     "min_lr_ratio": 0.1, "num_cycles": 0.5}], ids=["warmup", "cosine"])
def test_the_verl_optimizer_resumes_at_the_scheduled_lr(converted, tmp_path, optim, keep_verl_state):
    """At LR count k = 3 the VERL files hold what torch's AdamW + LambdaLR hold after k steps
    (group lr = initial_lr x lambda(k), _last_lr, last_epoch, _step_count, _is_initial), and
    the step after loading them is torch's: the base lr was written, and torch's
    load_state_dict keeps it while VERL steps the optimizer before the scheduler. Both for a
    run's own checkpoint and for one that keeps a VERL source's scheduler state."""
    import math
    import shutil

    import torch

    from convert.orbax_directions import orbax_state
    from jscenegen.checkpoint.checksums import write_checksums

    run = tmp_path / "run"
    shutil.copytree(converted["run"], run)
    step_dir = run / converted["step"].name
    meta_file = step_dir / "training_metadata.json"
    meta = json.loads(meta_file.read_text())
    meta["config"] = {"optim": optim}
    if not keep_verl_state:
        del meta["source"]
    meta_file.write_text(json.dumps(meta))
    write_checksums(step_dir)
    write_checksums(run)
    state = orbax_state(step_dir, 6)

    lo, warm = optim["min_lr_ratio"], optim["warmup_steps"]

    def lam(s):   # verl/utils/torch_functional.py, written out
        if s < warm:
            return float(s) / float(max(1, warm))
        if optim["lr_schedule"] == "constant":
            return 1.0
        x = math.cos(math.pi * 0.5 * 2.0 * float(s - warm) / float(max(1, optim["total_steps"] - warm)))
        return max(lo, x * (1 - lo) * 0.5 + (1 + lo) * 0.5)

    def torch_run():
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
        return p, opt, torch.optim.lr_scheduler.LambdaLR(opt, lam)

    p, opt, sched = torch_run()
    for _ in range(3):   # VERL: optimizer.step() then lr_scheduler.step()
        p.grad = torch.full((4,), 0.5)
        opt.step()
        sched.step()
    group = dict(state.adam.param_groups[0], params=[0])
    assert group == opt.state_dict()["param_groups"][0]
    assert group["lr"] == 1e-3 * lam(3) and group["initial_lr"] == 1e-3
    assert state.extra_states[0]["lr_scheduler"] == sched.state_dict()

    q, opt2, sched2 = torch_run()   # resume: torch's state, the converter's groups and scheduler
    with torch.no_grad():
        q.copy_(p)
    opt2.load_state_dict({"state": opt.state_dict()["state"], "param_groups": [group]})
    sched2.load_state_dict(state.extra_states[0]["lr_scheduler"])
    for t in (p, q):
        t.grad = torch.full((4,), 0.5)
    opt.step()
    opt2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-3 * lam(3)
    assert torch.equal(q, p)


def _edited_copy(converted, tmp_path, edit_adam=None, edit_meta=None):
    """A copy of the converted run whose step's adam/ or training_metadata.json another program
    rewrote, checksums written again (the step's and the run's): only the content can tell."""
    import shutil

    import orbax.checkpoint as ocp

    from jscenegen.checkpoint.checksums import write_checksums
    from jscenegen.checkpoint.store import iter_arrays, read_adam_count

    run = tmp_path / "run"
    shutil.copytree(converted["run"], run)
    step = run / converted["step"].name
    if edit_adam is not None:
        adam = {"count": np.asarray(read_adam_count(step), np.int32),
                "mu": dict(iter_arrays(step, "mu")), "nu": dict(iter_arrays(step, "nu"))}
        edit_adam(adam)
        handler = ocp.PyTreeCheckpointHandler()
        ocp.Checkpointer(handler).save(tmp_path / "adam", args=ocp.args.PyTreeSave(adam))
        handler.close()
        shutil.rmtree(step / "adam")
        shutil.move(tmp_path / "adam", step / "adam")
    if edit_meta is not None:
        meta = json.loads((step / "training_metadata.json").read_text())
        edit_meta(meta)
        (step / "training_metadata.json").write_text(json.dumps(meta))
    write_checksums(step)
    write_checksums(run)
    return run, step


@pytest.mark.parametrize("moment", ["mu", "nu"])
def test_a_moment_of_another_shape_than_its_parameter_is_refused_before_verl_files(
        converted, tmp_path, moment):
    """A moment with half its parameter's rows was written as VERL rank files whose local
    shards do not fit their parameter (an empty one on rank 1): the orbax side read names only."""
    import re

    from convert.errors import ConvertError

    victim = "model.layers.0.mlp.down_proj.weight"

    def halve(adam):
        adam[moment][victim] = adam[moment][victim][:adam[moment][victim].shape[0] // 2]

    run, step = _edited_copy(converted, tmp_path, edit_adam=halve)
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(step / 'adam'))}: {moment}\['"
                                           rf"{re.escape(victim)}'\] has shape \(24, 100\); its "
                                           rf"parameter params/\['{re.escape(victim)}'\] has "
                                           r"\(48, 100\)$"):
        orbax_to_verl(run, tmp_path / "verl", world_size=2, device_type="cpu")
    assert not (tmp_path / "verl").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(source="verl"), r"source is a str, expected an object"),
    (lambda m: m.update(config=[1]), r"config is a list, expected an object"),
    (lambda m: m["source"].update(verl=3), r"source\.verl is a int, expected an object"),
    (lambda m: m.update(config={"optim": "adamw"}), r"config\.optim is a str, expected an object"),
    (lambda m: m["source"]["verl"]["param_groups"][0].pop("betas"),
     r"source\.verl\.param_groups\[0\] has no betas"),
    (lambda m: m["source"]["verl"]["param_groups"][0].update(betas=0.9),
     r"source\.verl\.param_groups\[0\]\.betas is 0\.9, expected two numbers"),
    (lambda m: m["source"]["verl"].update(param_groups={"lr": 1}),
     r"source\.verl\.param_groups is a dict, expected a list"),
    # recorded RNG states without one VERL restores without a fallback (KeyError on resume)
    (lambda m: [e["rng"].pop("cpu") for e in m["source"]["verl"]["extra_state"]],
     r"rng has no 'cpu' state \('numpy', 'random' only\); VERL saves and, on resume, restores "
     r"cpu, numpy, random \(and its device's\) without a fallback"),
    # a second group with its own lr: the VERL files were written with the first group's only
    (lambda m: m["source"]["verl"]["param_groups"].append(
        dict(m["source"]["verl"]["param_groups"][0], lr=0.5, params=[])),
     r"source\.verl\.param_groups\[1\]\.lr \(0\.5 vs param_groups\[0\]'s 0\.001\); one AdamW "
     r"setting holds for every parameter \(a conversion from VERL refuses groups that differ\)"),
])
def test_malformed_step_metadata_that_verifies_is_named_by_file_and_key(converted, tmp_path, edit,
                                                                          message):
    """A `source` or `config` that is no object raised AttributeError, a param group without
    betas KeyError: tracebacks, not the file and key at fault."""
    import re

    from convert.errors import ConvertError
    from convert.orbax_directions import orbax_state

    _, step = _edited_copy(converted, tmp_path, edit_meta=edit)
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(step / 'training_metadata.json'))}: "
                                           rf"{message}$"):
        orbax_state(step, 6)


def test_a_resume_names_the_adamw_settings_that_differ_from_the_torch_run(converted):
    """A converted VERL step resumed with a config whose AdamW settings or schedule differ from
    the torch run's: the learning rate moved 20-66x with no word (helper-165); the trainer now
    warns with this list. The fixture trained at lr 1e-3 (betas 0.9/0.999, eps 1e-8, decay 0.01)
    and its LambdaLR reached 1.0 by count 3."""
    from jscenegen.checkpoint.resume import torch_optimizer_changes
    from jscenegen.checkpoint.store import read_metadata
    from jscenegen.grpo.algo.config import OptimConfig

    meta = read_metadata(converted["step"])
    assert torch_optimizer_changes(meta, OptimConfig(lr=1e-3), 3) == []
    other = OptimConfig(lr=5e-5, betas=(0.5, 0.9), warmup_steps=10)
    assert torch_optimizer_changes(meta, other, 3) == [
        "optim.lr 5e-05 (the torch run's 0.001)",
        "optim.betas [0.5, 0.9] (the torch run's [0.9, 0.999])",
        "the LR at count 3: 1.5e-05 (the torch run's 0.001)"]
    assert torch_optimizer_changes(meta, OptimConfig(lr=1e-3, warmup_steps=6), 3) == [
        "the LR at count 3: 0.0005 (the torch run's 0.001)"]
    assert torch_optimizer_changes({"config": {}}, other, 3) == []   # not a VERL conversion
    # mid-warmup, as VERL's LambdaLR leaves the group (lr = initial_lr x count / warmup): silent
    warming = {"source": {"verl": {"param_groups": [{
        "initial_lr": 1e-3, "lr": 1e-3 * 3 / 10, "betas": [0.9, 0.999], "eps": 1e-8,
        "weight_decay": 0.01}]}}}
    assert torch_optimizer_changes(warming, OptimConfig(lr=1e-3, warmup_steps=10), 3) == []
    # a hand-edited record of another shape is listed, not raised
    # groups of their own settings (a hand-edited record: conversions refuse them) are named
    two = {"source": {"verl": {"param_groups": [
        {"lr": 1e-3, "betas": [0.9, 0.999], "params": [0]},
        {"lr": 1e-3, "betas": [0.9, 0.95], "params": [1]}]}}}
    assert torch_optimizer_changes(two, OptimConfig(lr=1e-3), 3) == [
        "the torch run's param_groups[1].betas ([0.9, 0.95] vs param_groups[0]'s [0.9, 0.999]): "
        "only param_groups[0] is compared"]
    # and group 0 is still compared (the note alone hid a changed lr)
    assert torch_optimizer_changes(two, OptimConfig(lr=2e-3), 3)[1:] == [
        "optim.lr 0.002 (the torch run's 0.001)", "the LR at count 3: 0.002 (the torch run's 0.001)"]
    odd = {"source": {"verl": {"param_groups": [{"lr": [1e-3], "betas": 0.9}]}}}
    assert torch_optimizer_changes(odd, OptimConfig(lr=1e-3), 3) == [
        "optim.lr 0.001 (the torch run's [0.001])", "optim.betas [0.9, 0.999] (the torch run's 0.9)",
        "the LR at count 3: 0.001 (the torch run's [0.001])"]


def test_the_trainer_warns_when_it_resumes_a_torch_run_with_other_adamw_settings(converted, caplog):
    """`Trainer._check_saved`, the check a resume runs on the chosen step before any array is
    read, logs the list above for a converted step (and nothing when the settings agree)."""
    import types

    from jscenegen.checkpoint.store import HF_DIR, read_train_state
    from jscenegen.grpo.algo.config import OptimConfig
    from jscenegen.grpo.train.trainer import Trainer

    step_dir = converted["step"]
    saved = read_train_state(step_dir)
    for optim, said in ((OptimConfig(lr=1e-3), False), (OptimConfig(lr=2e-3), True)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            trainer = types.SimpleNamespace(   # the converted step's own tokenizer, no KL
                cfg=types.SimpleNamespace(optim=optim,
                                          sampling=types.SimpleNamespace(chat_template_path=None)),
                model_dir=step_dir / HF_DIR, _kl_reference=None)
            Trainer._check_saved(trainer, step_dir, int(step_dir.name), saved)
        assert ("was converted from a torch run with other AdamW settings: this run continues "
                "with optim.lr 0.002 (the torch run's 0.001)" in caplog.text) == said, caplog.text


def test_a_verl_step_without_scheduler_state_says_the_lr_count_is_its_global_step(tmp_path):
    """A step saved without its extra_state files (an interrupted save, helper-165) converted
    with its LR count silently set to the global step."""
    import shutil

    from convert.errors import ConversionWarning
    from jscenegen.checkpoint.store import CheckpointStore

    src = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("qwen2_first_divisible") / "ckpt", src)
    for f in (src / "global_step_3" / "actor").glob("extra_state_world_size_6_rank_*.pt"):
        f.unlink()
    with pytest.warns(ConversionWarning, match=r"global_step_3/actor: no LR scheduler state \(no "
                      r"extra_state_world_size_6_rank_\*\.pt files, or none holds lr_scheduler\): "
                      r"the LR count is taken as the global step, 3"):
        verl_to_orbax(src, tmp_path / "run")
    with CheckpointStore(tmp_path / "run") as store:
        assert store.restore().train_state["lr_schedule_count"] == 3


def test_a_bfloat16_output_with_adam_state_says_it_rounds_the_master_weights(converted, tmp_path):
    """--dtype bfloat16 into a resumable format rounds the fp32 masters that the Adam moments
    go with: every direction that writes both says so; float32 (or no --dtype) is silent."""
    import warnings

    from convert.directions import verl_to_verl
    from convert.errors import ConversionWarning

    src = converted["src"] / "ckpt"
    rounds = r"--dtype bfloat16 rounds the float32 master weights of \d+ parameters that have Adam"
    with pytest.warns(ConversionWarning, match=r"o16: " + rounds):   # the output, not the source
        verl_to_orbax(src, tmp_path / "o16", dtype="bfloat16")
    with pytest.warns(ConversionWarning, match=r"v16/global_step_3/actor: " + rounds):
        orbax_to_verl(converted["run"], tmp_path / "v16", world_size=2, dtype="bfloat16",
                      device_type="cpu")
    with pytest.warns(ConversionWarning, match=rounds):
        verl_to_verl(src, tmp_path / "vv16", world_size=3, dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rounds the", category=ConversionWarning)
        verl_to_orbax(src, tmp_path / "o32", dtype="float32")
        orbax_to_verl(converted["run"], tmp_path / "v32", world_size=2, device_type="cpu")


def test_orbax_to_verl_keeps_the_placement_of_the_verl_checkpoint_it_came_from(converted, tmp_path):
    """A step converted from first-divisible VERL files went back with dim0 placement unless
    --placement said otherwise; the metadata records the source's shard dims."""
    import re

    from convert.errors import ConversionWarning
    from convert.orbax_directions import source_placement
    from convert.sharding import shard_dim

    assert source_placement(converted["step"], VerlCheckpoint(converted["src"] / "ckpt").config) \
        == ("first-divisible",)
    out = orbax_to_verl(converted["run"], tmp_path / "verl", world_size=6, device_type="cpu")
    info = VerlCheckpoint(out).tensor_info()
    assert {k: v.shard_dim for k, v in info.items()} == {
        k: shard_dim(v.shape, 6, "first-divisible") for k, v in info.items()}
    assert sum(v.shard_dim == 1 for v in info.values()) == 12
    with pytest.warns(ConversionWarning, match=(
            rf"^{re.escape(str(tmp_path / 'd0'))}: written with placement dim0 where "
            rf"{re.escape(str(converted['run']))} is sharded by first-divisible")):
        orbax_to_verl(converted["run"], tmp_path / "d0", world_size=6, placement="dim0",
                      device_type="cpu")
