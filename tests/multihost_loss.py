"""The loss both the single-process and the multi-process runs compute."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jscenegen.model.hf_io import load_hf
from jscenegen.sharding.layout import pad_batch, shard_batch


def sharded_loss(hf_dir, mesh) -> float:
    model = load_hf(hf_dir, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, model.cfg.vocab_size, (4, 17)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    batch = shard_batch(pad_batch({"ids": ids, "mask": mask}, mesh), mesh)

    @jax.jit
    def loss_fn(params, ids, mask):
        logits = nnx.merge(graphdef, params)(ids, mask)[:, :-1]
        ll = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        w = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
        return -(ll * w).sum() / w.sum()

    with jax.set_mesh(mesh):
        loss = loss_fn(params, batch["ids"], batch["mask"])
    return float(np.asarray(loss.addressable_shards[0].data))
