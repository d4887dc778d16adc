"""Rematerialisation policies (`model.remat`, `model.remat_policy`): the same gradients as no
remat; `minimal` keeps the projections' outputs for the backward pass, `full` keeps none."""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jscenegen.model.config import preset_config
from jscenegen.model.qwen import QwenForCausalLM
from jscenegen.model.qwen35 import Qwen35ForCausalLM
from jscenegen.model.remat import remat_policy
from jscenegen.run_config import RunConfig

IDS = np.random.default_rng(0).integers(0, 1003, (2, 12)).astype(np.int32)
MASK = np.ones_like(IDS)


def _grad_fn(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return nnx.merge(graphdef, p, rest)(IDS, MASK).astype(jnp.float32).mean()
    return jax.grad(loss), params


def _saved(model) -> int:
    """How many residuals the backward pass of `model`'s loss keeps."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: nnx.merge(graphdef, p, rest)(IDS, MASK).mean(), params)
    return len(out.getvalue().splitlines())


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_policy_gives_the_gradients_of_no_remat(scan_layers):
    cfg = preset_config("qwen3", "tiny", vocab_size=1003, num_hidden_layers=2)
    grads = {}
    for remat in (False, "full", "minimal"):
        model = QwenForCausalLM(cfg, rngs=nnx.Rngs(0), remat=remat, scan_layers=scan_layers)
        grad, params = _grad_fn(model)
        grads[remat] = jax.tree.leaves(jax.jit(grad)(params))
    for remat in ("full", "minimal"):
        for a, b in zip(grads[False], grads[remat]):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch,scan_layers", [("qwen3", False), ("qwen3", True),
                                              ("qwen3_5_text", None)])
def test_minimal_keeps_the_projections_and_full_keeps_nothing(arch, scan_layers):
    cfg = preset_config(arch, "tiny", vocab_size=1003, num_hidden_layers=4)
    cls = Qwen35ForCausalLM if cfg.hybrid else QwenForCausalLM
    kw = {} if scan_layers is None else {"scan_layers": scan_layers}
    kept = {r: _saved(cls(cfg, rngs=nnx.Rngs(0), remat=r, **kw)) for r in (False, "full", "minimal")}
    # no remat keeps every intermediate; full only each layer's input; minimal adds the
    # projections' outputs (custom_vjp dense: saved by name, a dot policy alone saw none)
    assert kept[False] > kept["minimal"] > kept["full"], kept


def test_remat_policy_names():
    assert [remat_policy(r) for r in (False, None, True, "full", "minimal")] == \
        [None, None, "full", "full", "minimal"]
    with pytest.raises(ValueError, match="remat 'dots': choose False, True or one of full, minimal"):
        remat_policy("dots")
    model = RunConfig.model_validate({"model": {"remat": True, "remat_policy": "minimal"}}).model
    assert model.build_options()["remat"] == "minimal"
    assert RunConfig.model_validate({"model": {"remat_policy": "minimal"}}).model.build_options()["remat"] is False
