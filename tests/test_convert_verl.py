"""convert/verl_read.py and convert/verl_write.py against checkpoints written by torch FSDP2.

The fixtures (tests/fsdp_fixtures.py) are trained and saved by 6 real gloo ranks; their
ground truth is torch's own `full_tensor()` of every parameter and Adam moment. Qwen2 and
Qwen3 (dense), and the Qwen3.5 vision-language model in both VERL placements: untied with a
trained vision tower (Shard(1) tensors), and tied with a frozen tower (no Adam state for it).
"""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from convert.directions import verl_state, verl_to_verl, write_verl_run
from convert.errors import ConvertError
from convert.sharding import chunk_bounds, shard_dim
from convert.verl_read import VerlCheckpoint, find_verl
from convert.verl_write import AdamSource, dict_reader
from jscenegen.checkpoint.checksums import verify_checksums

from fsdp_fixtures import fixture_dir

NAMES = ("qwen2_first_divisible", "qwen3_tied_dim0", "qwen35_first_divisible",
         "qwen35_tied_frozen_dim0")


@pytest.fixture(scope="session", params=NAMES)
def fixture(request):
    out = fixture_dir(request.param)
    return {"ckpt": out / "ckpt", "params": load_file(str(out / "reference/params.safetensors")),
            "optim": load_file(str(out / "reference/optim.safetensors")),
            "meta": json.loads((out / "reference/meta.json").read_text()), "name": request.param}


def test_chunk_bounds_follow_torch_chunk():
    import torch

    for n in (0, 1, 5, 13, 14, 32, 1003):
        for w in (1, 3, 6, 7):
            pieces = list(torch.chunk(torch.arange(n), w)) if n else []
            sizes = [len(p) for p in pieces] + [0] * (w - len(pieces))
            assert [b - a for a, b in (chunk_bounds(n, w, r) for r in range(w))] == sizes
    assert shard_dim((32, 48), 6, "first-divisible") == 1
    assert shard_dim((100, 48), 6, "first-divisible") == 1
    assert shard_dim((48, 100), 6, "first-divisible") == 0
    assert shard_dim((1003, 40), 6, "first-divisible") == 0
    assert shard_dim((32, 48), 6, "dim0") == 0


def test_mesh_info_reads_both_pickle_generations(fixture):
    """torch 2.13 meshes (from the fixture) and the attribute set older torch pickled."""
    import torch

    from convert.torch_safe import load_pt
    from convert.verl_read import mesh_info

    sd = load_pt(fixture["ckpt"] / "global_step_3/actor/model_world_size_6_rank_4.pt")
    info = mesh_info(next(iter(sd.values())).device_mesh)
    assert info == {"dim_names": ("fsdp",), "sizes": (6,), "device_type": "cpu", "rank": 4,
                    "coordinate": (4,)}

    class OldMesh:  # torch <= 2.8: a rank tensor and plain attributes
        def __init__(self):
            self.device_type, self.mesh, self.mesh_dim_names = "cuda", torch.arange(6).view(2, 3), ("ddp", "fsdp")
            self._coordinate_on_dim = [1, 2]

    assert mesh_info(OldMesh()) == {"dim_names": ("ddp", "fsdp"), "sizes": (2, 3), "device_type": "cuda",
                                    "rank": None, "coordinate": (1, 2)}


def test_layout_detection(fixture, tmp_path):
    ckpt = fixture["ckpt"]
    run = find_verl(ckpt)
    step = find_verl(ckpt / "global_step_3")
    actor = find_verl(ckpt / "global_step_3" / "actor")
    assert (run.kind, step.kind, actor.kind) == ("run", "step", "actor")
    assert run.shard_dir == step.shard_dir == actor.shard_dir
    assert {run.global_step, step.global_step, actor.global_step} == {3}
    assert run.world_size == 6 and run.kinds == ("model", "optim", "extra_state")
    # the published layout: rank files directly in global_step_N
    flat = tmp_path / "training_state" / "global_step_3"
    shutil.copytree(actor.shard_dir, flat)
    f = find_verl(flat)
    assert (f.kind, f.global_step, f.world_size) == ("flattened", 3, 6)
    assert f.hf_dir == flat / "huggingface"


def test_params_equal_torch_full_tensors(fixture):
    ck = VerlCheckpoint(fixture["ckpt"])
    ref, meta = fixture["params"], fixture["meta"]
    # parameter order (optimizer indices) is torch's named_parameters() order
    assert ck.param_order == meta["param_order"]
    got = dict(ck.iter_params(include_tied_alias=True))
    assert list(got) == [k for k in meta["param_order"]] + (["lm_head.weight"] if ck.tied else [])
    assert set(got) == set(ref)
    for name, a in got.items():
        assert a.dtype == np.float32 and a.shape == ref[name].shape
        np.testing.assert_array_equal(a, ref[name], err_msg=name)
    # placements read per tensor, as torch wrote them
    info = ck.tensor_info()
    assert {k: v.shard_dim for k, v in info.items()} == meta["placements"]
    if meta["placement"] == "first-divisible":
        assert info[ck.embedding].shard_dim == 1
        assert info[ck.config.text_prefix + "layers.0.mlp.gate_proj.weight"].shard_dim == 1
    if ck.config.hybrid:  # the VLM: vision tower, text model, head; never mtp.*
        assert ck.param_order[0] == "model.visual.patch_embed.proj.weight"
        assert ck.embedding == "model.language_model.embed_tokens.weight"
        assert not [n for n in got if n.startswith("mtp.")]


def test_adam_state_and_extra_state(fixture):
    ck = VerlCheckpoint(fixture["ckpt"])
    ref, meta = fixture["optim"], fixture["meta"]
    names = []
    for name, m, v in ck.iter_adam():
        np.testing.assert_array_equal(m, ref[f"{name}.exp_avg"], err_msg=name)
        np.testing.assert_array_equal(v, ref[f"{name}.exp_avg_sq"], err_msg=name)
        names.append(name)
    # torch keeps state only for parameters it stepped: a frozen tower has none
    assert names == ck.trainable == [meta["param_order"][i] for i in meta["state_indices"]]
    assert ck.frozen == meta["frozen"] and set(ref) == {f"{n}.{k}" for n in names
                                                         for k in ("exp_avg", "exp_avg_sq")}
    if fixture["name"] == "qwen35_tied_frozen_dim0":
        assert ck.frozen and all(n.startswith("model.visual.") for n in ck.frozen)
        with pytest.raises(ConvertError, match="no AdamW state"):
            ck.read_moment(ck.frozen[0], "exp_avg")
    else:
        assert not ck.frozen
    n = len(meta["param_order"])
    assert n == len(ck.shapes)
    assert ck.adam_step() == int(meta["step"]) == 3
    groups = ck.param_groups()
    assert len(groups) == 1 and groups[0]["lr"] == meta["param_groups"][0]["lr"]
    assert groups[0]["params"] == list(range(n)) and groups[0]["weight_decay"] == 0.01
    assert ck.scheduler_step() == meta["lr_scheduler"]["last_epoch"] == 3
    extra = ck.extra_states()
    assert len(extra) == 6
    import torch

    for r, st in enumerate(extra):
        torch.manual_seed(77 + r)
        assert torch.equal(st["rng"]["cpu"], torch.get_rng_state())
        np.random.seed(88 + r)
        np.random.standard_normal()
        want = np.random.get_state()
        assert st["rng"]["numpy"][0] == "MT19937"
        np.testing.assert_array_equal(st["rng"]["numpy"][1], want[1])
        assert tuple(st["rng"]["numpy"][2:]) == tuple(want[2:])
        random.seed(99 + r)
        assert st["rng"]["random"] == random.getstate()


def _shard_entries(path):
    from convert.torch_safe import load_pt

    return load_pt(path)


def test_round_trip_through_numpy_is_bitwise(fixture, tmp_path):
    """verl -> numpy -> verl at the same W and placement: every local shard, placement, moment
    and step identical to what torch FSDP2 saved."""
    import torch

    ck = VerlCheckpoint(fixture["ckpt"])
    params = dict(ck.iter_params())
    mu, nu = {}, {}
    for name, m, v in ck.iter_adam():
        mu[name], nu[name] = m, v
    state = verl_state(ck)
    state.params = dict_reader(params)
    state.adam = AdamSource(dict_reader(mu), dict_reader(nu), ck.adam_step(), ck.param_groups(),
                            names=ck.trainable)
    placement = fixture["meta"]["placement"]
    out = tmp_path / "out"
    write_verl_run(out, state, world_size=6, placement=placement, device_type="cpu",
                   source=fixture["ckpt"], source_format="verl")
    assert verify_checksums(out) > 0
    layout = json.loads((out / "checkpoint-layout.json").read_text())
    assert layout["torch_version"] == torch.__version__ and layout["world_size"] == 6
    src_dir = ck.layout.shard_dir
    dst_dir = out / "global_step_3" / "actor"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert json.loads((dst_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 6}
    for r in range(6):
        a = _shard_entries(src_dir / f"model_world_size_6_rank_{r}.pt")
        b = _shard_entries(dst_dir / f"model_world_size_6_rank_{r}.pt")
        assert list(a) == list(b)
        for k in a:
            assert a[k].placements == b[k].placements, k
            assert a[k].device_mesh.mesh_dim_names == b[k].device_mesh.mesh_dim_names == ("fsdp",)
            assert torch.equal(a[k].to_local(), b[k].to_local()), (r, k)
        oa = _shard_entries(src_dir / f"optim_world_size_6_rank_{r}.pt")
        ob = _shard_entries(dst_dir / f"optim_world_size_6_rank_{r}.pt")
        assert oa["param_groups"] == ob["param_groups"]
        assert sorted(oa["state"]) == sorted(ob["state"])
        for i in oa["state"]:
            for key in ("exp_avg", "exp_avg_sq"):
                assert oa["state"][i][key].placements == ob["state"][i][key].placements
                assert torch.equal(oa["state"][i][key].to_local(), ob["state"][i][key].to_local())
            assert torch.equal(oa["state"][i]["step"], ob["state"][i]["step"])
            assert ob["state"][i]["step"].dtype == torch.float32 and ob["state"][i]["step"].dim() == 0
        ea = _shard_entries(src_dir / f"extra_state_world_size_6_rank_{r}.pt")
        eb = _shard_entries(dst_dir / f"extra_state_world_size_6_rank_{r}.pt")
        assert ea["lr_scheduler"] == eb["lr_scheduler"]
        assert torch.equal(ea["rng"]["cpu"], eb["rng"]["cpu"])


def test_reshard_to_other_world_sizes(fixture, tmp_path):
    ck = VerlCheckpoint(fixture["ckpt"])
    for w, placement in ((3, "dim0"), (4, "first-divisible")):
        out = tmp_path / f"w{w}"
        import contextlib

        from convert.errors import ConversionWarning

        # named: the source's VERL version shards otherwise; the dim0 fixtures' sizes do not
        # divide by 6, so first-divisible too puts them on dim 0: their files fit both rules
        fits = {"first-divisible": ("first-divisible",),
                "dim0": ("dim0", "first-divisible")}[fixture["meta"]["placement"]]
        assert ck.placement() == fits
        other = placement not in fits
        with (pytest.warns(ConversionWarning, match=f"written with placement {placement} where")
              if other else contextlib.nullcontext()):
            verl_to_verl(fixture["ckpt"], out, world_size=w, placement=placement, device_type="cpu")
        ck2 = VerlCheckpoint(out)
        assert ck2.world_size == w
        for (n1, a1), (n2, a2) in zip(ck.iter_params(include_tied_alias=True),
                                      ck2.iter_params(include_tied_alias=True)):
            assert n1 == n2
            np.testing.assert_array_equal(a1, a2)
        for (n1, m1, v1), (n2, m2, v2) in zip(ck.iter_adam(), ck2.iter_adam()):
            np.testing.assert_array_equal(m1, m2)
            np.testing.assert_array_equal(v1, v2)
        assert ck2.adam_step() == ck.adam_step() and ck2.scheduler_step() == ck.scheduler_step()
        dims = {k: v.shard_dim for k, v in ck2.tensor_info().items()}
        assert dims == {k: shard_dim(tuple(v.shape), w, placement)
                        for k, v in ck2.tensor_info().items()}


def test_writer_refuses_existing_destination(fixture, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="already exists"):
        verl_to_verl(fixture["ckpt"], out, world_size=2)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_adam_indices_follow_the_model_files_key_order(tmp_path):
    """A model whose parameters() order puts post_attention_layernorm before input_layernorm
    (another transformers version, a patched model): torch's AdamW indices follow that order,
    which is the model file's. The index -> name map came from jscenegen's weight table alone,
    so the two norms' moments were silently swapped (same shapes)."""
    import collections
    import re

    import torch

    from convert.errors import ConversionWarning
    from convert.torch_safe import load_pt

    fix = fixture_dir("qwen2_first_divisible")
    src = fix / "ckpt" / "global_step_3" / "actor"
    actor = tmp_path / "global_step_3" / "actor"
    shutil.copytree(src, actor)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    for r in range(6):
        model = load_pt(src / f"model_world_size_6_rank_{r}.pt", mmap=False)
        keys = list(model)
        i, j = keys.index(a), keys.index(b)
        keys[i], keys[j] = keys[j], keys[i]
        torch.save(collections.OrderedDict((k, model[k]) for k in keys),
                   actor / f"model_world_size_6_rank_{r}.pt")
        optim = load_pt(src / f"optim_world_size_6_rank_{r}.pt", mmap=False)
        optim["state"][i], optim["state"][j] = optim["state"][j], optim["state"][i]
        torch.save(optim, actor / f"optim_world_size_6_rank_{r}.pt")
    ref = load_file(str(fix / "reference/optim.safetensors"))
    warned = (rf"^{re.escape(str(actor / 'model_world_size_6_rank_0.pt'))}: parameter {i} is "
              rf"{re.escape(b)} where jscenegen's weight table for this config has {re.escape(a)}: "
              r"the AdamW state is indexed in the file's order \(torch's module\.parameters\(\)\), "
              r"as read here; VERL files written from an orbax or HF source follow the table's order$")
    with pytest.warns(ConversionWarning, match=warned):
        ck = VerlCheckpoint(actor)
    assert ck.param_order == keys and list(ck.shapes) == keys
    for name in (a, b):
        for moment in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(ck.read_moment(name, moment), ref[f"{name}.{moment}"])
    assert not np.array_equal(ref[f"{a}.exp_avg"], ref[f"{b}.exp_avg"])   # the test can tell
    # a reshard keeps the source's order, for the model keys and the optimizer's indices alike
    with pytest.warns(ConversionWarning, match="parameter"):
        out = verl_to_verl(actor, tmp_path / "w3", world_size=3)
    assert list(_shard_entries(out / "model_world_size_3_rank_0.pt")) == keys
    with pytest.warns(ConversionWarning, match="parameter"):
        back = VerlCheckpoint(out)
    for name, m, v in back.iter_adam():
        np.testing.assert_array_equal(m, ref[f"{name}.exp_avg"], err_msg=name)
        np.testing.assert_array_equal(v, ref[f"{name}.exp_avg_sq"], err_msg=name)
    # every rank saves one module: a rank whose file lists another order is refused
    other = load_pt(src / "model_world_size_6_rank_4.pt", mmap=False)
    torch.save(other, actor / "model_world_size_6_rank_4.pt")
    with pytest.raises(ConvertError, match=(
            rf"^{re.escape(str(actor / 'model_world_size_6_rank_4.pt'))}: key {i} is {re.escape(a)}, "
            rf"rank 0's {re.escape(b)}; every rank saves the same module's state_dict, in one order$")):
        VerlCheckpoint(actor)


def test_rng_states_a_cuda_run_cannot_restore_are_left_out_with_a_warning(tmp_path):
    """The fixture's states come from a CPU (gloo) run: no "cuda" generator. Written for a cuda
    mesh, VERL's load_rng_state raised KeyError('cuda') on resume; its load skips a missing rng.
    For a cpu mesh they are carried as they are."""
    import re

    import torch

    from convert.errors import ConversionWarning
    from convert.torch_safe import load_pt

    src = fixture_dir("qwen2_first_divisible") / "ckpt"
    want = (rf"^{re.escape(str(tmp_path / 'cuda'))}: the RNG states of "
            rf"{re.escape(str(src))} hold no 'cuda' generator \(saved by a cpu/numpy/random run\), "
            r"which VERL restores on a cuda run without a fallback: left out of the extra_state "
            r"files \(VERL then keeps its own seeded random streams; the scheduler state is kept\)$")
    with pytest.warns(ConversionWarning, match=want):
        out = verl_to_verl(src, tmp_path / "cuda", world_size=6, device_type="cuda")
    source = VerlCheckpoint(src).extra_states()
    for r in range(6):
        extra = load_pt(out / f"extra_state_world_size_6_rank_{r}.pt")
        assert set(extra) == {"lr_scheduler"} and extra["lr_scheduler"] == source[r]["lr_scheduler"]
    out = verl_to_verl(src, tmp_path / "cpu", world_size=6, device_type="cpu")
    extra = load_pt(out / "extra_state_world_size_6_rank_5.pt")
    assert torch.equal(extra["rng"]["cpu"], source[5]["rng"]["cpu"])
    assert extra["rng"]["random"] == source[5]["rng"]["random"]


def test_files_that_fit_both_placements_are_named_when_the_output_would_differ():
    """Every tensor divisible by the source's W (all on dim 0) fits both VERL rules: read as
    dim0, a VERL 0.6 - 0.8 run resharded to a W it does not divide moved its Shard(1) tensors
    to dim 0 without a word."""
    import warnings

    from convert.directions import output_placement
    from convert.errors import ConversionWarning
    from convert.sharding import placement_of

    shapes = {"model.embed_tokens.weight": (1000, 64), "model.norm.weight": (64,)}
    dims = {"model.embed_tokens.weight": 0, "model.norm.weight": 0}
    assert placement_of(shapes, dims, 8) == ("dim0", "first-divisible")
    assert placement_of(shapes, {**dims, "model.embed_tokens.weight": 1}, 8) == ()
    assert placement_of({"w": (10, 64)}, {"w": 0}, 8) == ("dim0",)
    assert placement_of({"w": (10, 64)}, {"w": 1}, 8) == ("first-divisible",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # at W = 4 both rules agree: nothing to say
        assert output_placement(None, ("dim0", "first-divisible"), shapes, 4, "src", "dst") == "dim0"
        # nor when no dim divides: first-divisible then falls back to dim 0 too
        assert placement_of({"w": (1003, 7)}, {"w": 0}, 6) == ("dim0", "first-divisible")
    with pytest.warns(ConversionWarning, match=(
            r"^dst: src's shard dims fit both VERL placements .* over 16 ranks they differ "
            r"\(model.embed_tokens.weight: dim 0 under dim0, 1 under first-divisible\): written "
            r"with dim0 \(VERL 0.9\); give --placement first-divisible for a VERL 0.6 - 0.8 run$")):
        assert output_placement(None, ("dim0", "first-divisible"), shapes, 16, "src", "dst") == "dim0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # told another rule, which shards alike at W = 4
        assert output_placement("first-divisible", ("dim0",), shapes, 4, "src", "dst") == \
            "first-divisible"
    with pytest.warns(ConversionWarning, match=r"^dst: written with placement first-divisible "
                      r"where src is sharded by dim0 "):   # but not at 16
        output_placement("first-divisible", ("dim0",), shapes, 16, "src", "dst")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # told: either fits the source
        assert output_placement("first-divisible", ("dim0", "first-divisible"), shapes, 16, "src",
                                "dst") == "first-divisible"


def test_a_reshard_keeps_the_sources_placement_unless_told(tmp_path):
    """VERL -> VERL defaulted to dim0: the Shard(1) tensors of a VERL 0.6 - 0.8 checkpoint
    (first-divisible) moved to Shard(0) without a word."""
    import re

    from convert.errors import ConversionWarning

    src = fixture_dir("qwen2_first_divisible") / "ckpt"
    assert VerlCheckpoint(src).placement() == ("first-divisible",)
    assert VerlCheckpoint(fixture_dir("qwen3_tied_dim0") / "ckpt").placement() == (
        "dim0", "first-divisible")   # no size divides by 6: both rules put all on dim 0
    for w in (6, 3):
        out = verl_to_verl(src, tmp_path / f"w{w}", world_size=w, device_type="cpu")
        info = VerlCheckpoint(out).tensor_info()
        dims = {k: v.shard_dim for k, v in info.items()}
        assert dims == {k: shard_dim(v.shape, w, "first-divisible") for k, v in info.items()}
        assert sum(d == 1 for d in dims.values()) == 12
        layout = json.loads((tmp_path / f"w{w}" / "checkpoint-layout.json").read_text())
        assert layout["placement"] == "first-divisible"
    with pytest.warns(ConversionWarning, match=(
            rf"^{re.escape(str(tmp_path / 'd0'))}: written with placement dim0 where "
            rf"{re.escape(str(src))} is sharded by first-divisible \(VERL 0\.6 - 0\.8; dim0: VERL "
            r"0\.9\): a run of the source's VERL version shards otherwise$")):
        out = verl_to_verl(src, tmp_path / "d0", world_size=6, placement="dim0", device_type="cpu")
    assert {v.shard_dim for v in VerlCheckpoint(out).tensor_info().values()} == {0}


def _write_on_2d_mesh(src, dst, monkeypatch, placements, piece):
    """Reshard the VERL checkpoint `src` to 6 rank files at `dst` whose DTensors live on a 2-D
    ("ddp", "fsdp") = (2, 3) mesh: the writer (convert/verl_write.py) is driven onto that mesh,
    each tensor's placements are `placements(shard dim)` and rank r holds torch.chunk piece
    `piece(r)` of 2 or 3 (`piece(r) = (pieces, index)`) along the shard dim."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import convert.verl_write as vw
    from convert.tensors import to_torch

    @contextlib.contextmanager
    def rank_on_2d_mesh(rank, world_size, device_type):
        assert world_size == 6
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        try:
            yield init_device_mesh(device_type, (2, 3), mesh_dim_names=("ddp", "fsdp"))
        finally:
            dist.destroy_process_group()

    def dtensor_2d(local, mesh, dim, shape, device_type):
        t = to_torch(np.array(local, copy=True))
        stride = torch.empty(shape, dtype=t.dtype, device="meta").stride()
        spec = DTensorSpec(mesh, placements(dim), TensorMeta(torch.Size(shape), stride, t.dtype))
        return DTensor(t, spec, requires_grad=False)

    hook = __import__("sys").excepthook
    with monkeypatch.context() as m:
        m.setattr(vw, "_fake_rank", rank_on_2d_mesh)
        m.setattr(vw, "_dtensor", dtensor_2d)
        m.setattr(vw, "chunk_bounds", lambda n, w, r: chunk_bounds(n, *piece(r)))
        try:
            verl_to_verl(src, dst, world_size=6, placement=VerlCheckpoint(src).placement()[0],
                         device_type="cpu")
        finally:
            __import__("sys").excepthook = hook
    return dst


@pytest.mark.parametrize("name", ["qwen2_first_divisible", "qwen3_tied_dim0"])
def test_hsdp_rank_files_read_back_the_full_tensors(name, tmp_path, monkeypatch):
    """HSDP (VERL's 2-D ("ddp", "fsdp") mesh, placements (Replicate(), Shard(d))): 6 ranks as
    2 replicas x 3 shards, rank r holding torch.chunk piece r % 3 (its fsdp coordinate). The
    writer is driven onto that mesh; the reader must take the first fsdp group's shards in
    order and give back torch's full tensors and Adam moments (the 1-D fixtures never reach
    the reader's HSDP path)."""
    from torch.distributed.tensor import Replicate, Shard

    src = fixture_dir(name) / "ckpt"
    ck = VerlCheckpoint(src)
    _write_on_2d_mesh(src, tmp_path / "hsdp", monkeypatch, lambda d: (Replicate(), Shard(d)),
                      lambda r: (3, r % 3))
    hsdp = VerlCheckpoint(tmp_path / "hsdp")
    first = hsdp._model_files[0][ck.embedding]
    assert tuple(first.placements) == (Replicate(), Shard(ck.tensor_info()[ck.embedding].shard_dim))
    assert hsdp.world_size == 6
    # every name, in order (a reader giving back fewer tensors or moments, e.g. one replica
    # group's part, fails here), then every value
    want = [(n, np.array(a)) for n, a in ck.iter_params(include_tied_alias=True)]
    got = [(n, np.array(a)) for n, a in hsdp.iter_params(include_tied_alias=True)]
    assert [n for n, _ in got] == [n for n, _ in want] and len(want) > 1
    for (n1, a1), (_, a2) in zip(want, got, strict=True):
        np.testing.assert_array_equal(a1, a2, err_msg=n1)
    want = [(n, np.array(m), np.array(v)) for n, m, v in ck.iter_adam()]
    got = [(n, np.array(m), np.array(v)) for n, m, v in hsdp.iter_adam()]
    assert [n for n, *_ in got] == [n for n, *_ in want] and len(want) > 1
    for (n1, m1, v1), (_, m2, v2) in zip(want, got, strict=True):
        np.testing.assert_array_equal(m1, m2, err_msg=n1)
        np.testing.assert_array_equal(v1, v2, err_msg=n1)
    assert hsdp.adam_step() == ck.adam_step()


def test_a_2d_mesh_sharded_over_ddp_is_refused_naming_file_key_and_placement(tmp_path, monkeypatch):
    """A 2-D ("ddp", "fsdp") mesh whose first placement is not Replicate: here (Shard(d),
    Replicate()), each of the 2 ddp groups holding half of every tensor and its 3 fsdp ranks
    copies of that half (true DTensors: the local data are the pieces the placements say).
    Not HSDP (the reader takes the first fsdp group's shards as the whole tensor): refused when
    the checkpoint is opened, naming the rank file, the entry and the placements."""
    import re

    from torch.distributed.tensor import Replicate, Shard

    from convert.directions import verl_to_hf
    from convert.torch_safe import load_pt

    src = fixture_dir("qwen2_first_divisible") / "ckpt"
    out = _write_on_2d_mesh(src, tmp_path / "ddp_sharded", monkeypatch,
                            lambda d: (Shard(d), Replicate()), lambda r: (2, r // 3))
    rank0 = find_verl(out).rank_file("model", 0)
    key, t = next(iter(load_pt(rank0, mmap=False).items()))
    d = VerlCheckpoint(src).tensor_info()[key].shard_dim
    assert tuple(t.placements) == (Shard(d), Replicate()) and t.device_mesh.mesh_dim_names == ("ddp", "fsdp")
    want = (rf"^{re.escape(str(rank0))}: {re.escape(key)} HSDP placement "
            rf"\(Shard\(dim={d}\), Replicate\(\)\) is not \(Replicate, Shard\)$")
    with pytest.raises(ConvertError, match=want):
        VerlCheckpoint(out)
    with pytest.raises(ConvertError, match=want):
        verl_to_hf(out, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
