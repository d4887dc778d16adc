"""VERL files we write load into real torch FSDP2 (gloo, CPU) and training continues.

Slow: each case forks W torch ranks (tests/fsdp_fixtures.py `load`, which mirrors VERL's
`FSDPCheckpointManager.load_checkpoint`: model, optimizer, scheduler and RNG state).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.directions import hf_to_verl, verl_to_hf
from convert.orbax_directions import orbax_to_hf, orbax_to_verl, verl_to_orbax

from fsdp_fixtures import fixture_dir, run_script

pytestmark = pytest.mark.slow


def _load(ckpt_actor, out, world_size, placement):
    run_script(["load", str(ckpt_actor), str(out), "--world-size", str(world_size),
                "--placement", placement])
    return (load_file(str(out / "loaded_params.safetensors")),
            load_file(str(out / "stepped_params.safetensors")),
            json.loads((out / "meta.json").read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fixture's own files, and verl -> orbax -> verl at W = 6 and W = 3 (written
    separately), each loaded into FSDP2 and stepped."""
    root = tmp_path_factory.mktemp("fsdp_load")
    src = fixture_dir("qwen2_first_divisible")
    placement = "first-divisible"
    out = {"ref_params": load_file(str(src / "reference/params.safetensors")),
           "ref_optim": load_file(str(src / "reference/optim.safetensors"))}
    out["orig"] = _load(src / "ckpt/global_step_3/actor", root / "orig", 6, placement)
    verl_to_orbax(src / "ckpt", root / "orbax")
    for w in (6, 3):
        orbax_to_verl(root / "orbax", root / f"w{w}", world_size=w, placement=placement,
                      device_type="cpu")
        out[w] = _load(root / f"w{w}/global_step_3/actor", root / f"load{w}", w, placement)
        out[f"optim{w}"] = load_file(str(root / f"load{w}/loaded_optim.safetensors"))
    return out


@pytest.mark.parametrize("w", [6, 3])
def test_written_files_load_bitwise(runs, w):
    loaded, _, meta = runs[w]
    for k, ref in runs["ref_params"].items():
        np.testing.assert_array_equal(loaded[k], ref, err_msg=k)
    for k, ref in runs["ref_optim"].items():
        np.testing.assert_array_equal(runs[f"optim{w}"][k], ref, err_msg=k)
    assert meta["step_before"] == 3.0 and meta["step_after"] == 4.0
    assert meta["last_epoch_after"] == 4  # scheduler state carried over
    # torch laid the loaded parameters out as FSDP2 does at this W (uneven and empty shards)
    assert [s["model.embed_tokens.weight"] for s in meta["local_shapes"]] == (
        [[1003, 8]] * 6 if w == 6 else [[1003, 16]] * 3)


def test_training_continues_identically(runs):
    """One more AdamW step after loading: our W = 6 files give exactly the step torch takes
    from its own files; W = 3 agrees to float rounding of the gradient reduction."""
    _, stepped_orig, _ = runs["orig"]
    _, stepped6, _ = runs[6]
    _, stepped3, _ = runs[3]
    for k in stepped_orig:
        np.testing.assert_array_equal(stepped6[k], stepped_orig[k], err_msg=k)
        np.testing.assert_allclose(stepped3[k], stepped_orig[k], rtol=0, atol=1e-7, err_msg=k)
        assert not np.array_equal(stepped_orig[k], runs["ref_params"][k]), k  # it did move


def test_hf_to_verl_starts_a_torch_run(tmp_path):
    """Model-only files from an HF directory (tied qwen3) load into 6 FSDP2 ranks."""
    src = fixture_dir("qwen3_tied_dim0")
    ref = load_file(str(src / "reference/params.safetensors"))
    verl_to_hf(src / "ckpt", tmp_path / "hf")
    hf_to_verl(tmp_path / "hf", tmp_path / "verl", world_size=6, placement="dim0",
               device_type="cpu")
    loaded, stepped, meta = _load(tmp_path / "verl/global_step_0/actor", tmp_path / "load", 6, "dim0")
    for k in ref:
        np.testing.assert_array_equal(loaded[k], ref[k], err_msg=k)
    assert meta["step_before"] == 0.0 and meta["step_after"] == 1.0
    np.testing.assert_array_equal(stepped["lm_head.weight"], stepped["model.embed_tokens.weight"])


# ---------------------------------------------------------------- Qwen3.5 VLM
# (fixture, placement, load flags): the trained tower steps on an image batch, the frozen one
# stays frozen, as in the runs that wrote them
QWEN35 = {"qwen35_first_divisible": ("first-divisible", ["--image"]),
          "qwen35_tied_frozen_dim0": ("dim0", ["--freeze-vision"])}


@pytest.fixture(scope="module", params=sorted(QWEN35))
def runs35(request, tmp_path_factory):
    """A Qwen3.5 fixture's own files, and verl -> orbax (mtp.* from the release) -> verl at
    W = 6 and W = 3, each loaded into 6 / 3 FSDP2 ranks of Qwen3_5ForConditionalGeneration
    and stepped once more."""
    name = request.param
    placement, flags = QWEN35[name]
    root = tmp_path_factory.mktemp(name)
    src = fixture_dir(name)

    def load(actor, out, w):
        run_script(["load", str(actor), str(out), "--world-size", str(w), "--placement",
                    placement, *flags])
        return {"loaded": load_file(str(out / "loaded_params.safetensors")),
                "optim": load_file(str(out / "loaded_optim.safetensors")),
                "stepped": load_file(str(out / "stepped_params.safetensors")),
                "meta": json.loads((out / "meta.json").read_text())}

    out = {"ref_params": load_file(str(src / "reference/params.safetensors")),
           "ref_optim": load_file(str(src / "reference/optim.safetensors")),
           "meta": json.loads((src / "reference/meta.json").read_text()), "name": name,
           "orig": load(src / "ckpt/global_step_3/actor", root / "orig", 6)}
    verl_to_orbax(src / "ckpt", root / "orbax", carried_from=src / "release")
    for w in (6, 3):
        orbax_to_verl(root / "orbax", root / f"w{w}", world_size=w, placement=placement,
                      device_type="cpu")
        out[w] = load(root / f"w{w}/global_step_3/actor", root / f"load{w}", w)
    return out


@pytest.mark.parametrize("w", [6, 3])
def test_qwen35_written_files_load_bitwise(runs35, w):
    got = runs35[w]
    assert set(got["loaded"]) == set(runs35["ref_params"])  # tower, text, head (tied alias)
    for k, ref in runs35["ref_params"].items():
        np.testing.assert_array_equal(got["loaded"][k], ref, err_msg=k)
    assert set(got["optim"]) == set(runs35["ref_optim"])  # no moments for a frozen tower
    for k, ref in runs35["ref_optim"].items():
        np.testing.assert_array_equal(got["optim"][k], ref, err_msg=k)
    meta = got["meta"]
    assert meta["state_indices_loaded"] == runs35["meta"]["state_indices"]
    assert meta["state_indices_after"] == runs35["meta"]["state_indices"]  # frozen stays frozen
    assert meta["step_before"] == 3.0 and meta["step_after"] == 4.0 and meta["last_epoch_after"] == 4


def test_qwen35_training_continues_identically(runs35):
    """One more step from our W = 6 files is bitwise the step torch takes from its own files
    (W = 3: torch's reductions over 3 ranks round differently, within an ulp, 1.2e-7 x
    max(1, |p|); an absolute 1e-7 failed on a weight of 1.19 by its one ulp); a frozen tower
    does not move, a trained one does."""
    orig = runs35["orig"]["stepped"]
    frozen = set(runs35["meta"]["frozen"])
    for k in orig:
        np.testing.assert_array_equal(runs35[6]["stepped"][k], orig[k], err_msg=k)
        assert np.all(np.abs(runs35[3]["stepped"][k] - orig[k])
                      <= 1.2e-7 * np.maximum(1.0, np.abs(orig[k]))), k
        moved = not np.array_equal(orig[k], runs35["ref_params"][k])
        assert moved == (k not in frozen), k


def test_qwen35_verl_to_grpo_resume_and_back_to_fsdp2(tmp_path):
    """The whole story: torch FSDP2 trains a Qwen3.5 VLM (tower frozen) and saves VERL shards
    -> orbax (mtp.* from the release) -> jscenegen resumes GRPO on the 3 x 2 mesh from the
    converted checkpoint's own hf/ and takes one update -> VERL again -> 6 FSDP2 ranks load it
    bitwise and train on; the tower and mtp.* come through the whole loop bit for bit, the
    text moved, and HF gets every tensor back."""
    from jscenegen.checkpoint.resume import resume_model_dir
    from jscenegen.checkpoint.store import CheckpointStore
    from jscenegen.config import load_config
    from jscenegen.grpo.train.trainer import Trainer
    from jscenegen.model.safetensors_stream import read_tensor, safetensors_files
    from jscenegen.paths import resolve_data_path
    from jscenegen.run_config import RunConfig

    from chat_fixtures import qwen35_chat_model_dir

    release = qwen35_chat_model_dir()  # protocol tokenizer, tied, tower and mtp.* (fp32)
    fsdp = tmp_path / "fsdp"
    run_script(["build", str(fsdp), "--arch", "qwen35_tied_frozen", "--world-size", "6",
                "--placement", "dim0", "--release", str(release)])
    torch_params = load_file(str(fsdp / "reference/params.safetensors"))
    run = tmp_path / "run"
    verl_to_orbax(fsdp / "ckpt", run / "checkpoints", carried_from=release)

    overrides = [f"model.path={release}", "mesh.fsdp=3", "mesh.sp=2",
                 "sampling.max_new_tokens=8", "sampling.max_episode_tokens=2560",
                 "sampling.buckets=[64,256,1024,2048,4096]", "schedule.num_scenes=3",
                 "schedule.group_size=2", "schedule.total_updates=4", "schedule.roles=PPC",
                 "schedule.zero_spread=count", "loss.entropy_coeff=0.01", "optim.lr=1e-3",
                 "checkpoint.save_every=1", "logging.swanlab_mode=disabled",
                 "trainer.progress=false"]
    cfg = load_config(resolve_data_path("configs/cpu-qwen35.yaml"), overrides, RunConfig)
    trainer = Trainer(cfg, run, resume_model_dir(run), resume=True)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert summary.attempts == 4  # converted at global step 3, one update taken
    with CheckpointStore(run / "checkpoints") as store:
        ck = store.restore()
    assert ck.step == 4 and int(ck.adam["count"]) == 4

    back = tmp_path / "verl"
    orbax_to_verl(run / "checkpoints", back, world_size=6, placement="dim0", device_type="cpu")
    run_script(["load", str(back / "global_step_4/actor"), str(tmp_path / "load"),
                "--world-size", "6", "--placement", "dim0", "--freeze-vision"])
    loaded = load_file(str(tmp_path / "load/loaded_params.safetensors"))
    loaded_optim = load_file(str(tmp_path / "load/loaded_optim.safetensors"))
    meta = json.loads((tmp_path / "load/meta.json").read_text())
    assert meta["step_before"] == 4.0 and meta["step_after"] == 5.0
    for name, a in loaded.items():
        want = ck.params["model.language_model.embed_tokens.weight" if name == "lm_head.weight" else name]
        np.testing.assert_array_equal(a, want, err_msg=name)  # what JAX saved, bitwise in torch
        if name.startswith("model.visual."):  # frozen through torch, JAX and torch again
            np.testing.assert_array_equal(a, torch_params[name], err_msg=name)
    assert not np.array_equal(loaded["model.language_model.norm.weight"],
                              torch_params["model.language_model.norm.weight"])  # JAX trained it
    assert set(loaded_optim) == {f"{n}.{k}" for n in ck.adam["mu"] for k in ("exp_avg", "exp_avg_sq")}
    for n in ck.adam["mu"]:
        np.testing.assert_array_equal(loaded_optim[f"{n}.exp_avg"], ck.adam["mu"][n], err_msg=n)
        np.testing.assert_array_equal(loaded_optim[f"{n}.exp_avg_sq"], ck.adam["nu"][n], err_msg=n)

    orbax_to_hf(run / "checkpoints", tmp_path / "hf")
    got = {n: read_tensor(f, n) for n, f in safetensors_files(tmp_path / "hf").items()}
    rel = {n: read_tensor(f, n) for n, f in safetensors_files(release).items()}
    assert set(got) == set(rel)
    for n in rel:
        if n.startswith("mtp."):
            np.testing.assert_array_equal(got[n], rel[n], err_msg=n)
        else:
            np.testing.assert_array_equal(got[n], np.asarray(ck.params[n]), err_msg=n)
