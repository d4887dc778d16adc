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


def test_hf_to_orbax_without_tokenizer_is_refused(tiny_hf, tmp_path):
    from convert.errors import ConvertError

    with pytest.raises(ConvertError, match="no tokenizer"):
        hf_to_orbax(tiny_hf["qwen2"], tmp_path / "run")
    assert not (tmp_path / "run").exists()
