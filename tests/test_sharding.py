"""FSDP2-style parameter sharding and sequence parallelism on real 6-device CPU meshes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jscenegen.model.config import preset_config
from jscenegen.model.hf_io import load_hf
from jscenegen.model.qwen import QwenForCausalLM
from jscenegen.model.weights import named_params, param_shapes
from jscenegen.sharding.layout import layout_report, pad_batch, shard_batch, shard_model
from jscenegen.sharding.mesh import MeshError, make_mesh, mesh_shape

MESHES = [(3, 2), (6, 1), (1, 2), None]


def test_mesh_shape_resolution_and_errors():
    assert mesh_shape(6, -1, 2) == (3, 2)
    assert mesh_shape(6, 6, 1) == (6, 1)
    with pytest.raises(MeshError, match="sp=4 does not divide the 6 devices"):
        mesh_shape(6, -1, 4)
    with pytest.raises(MeshError, match="fsdp=4 x sp=2 = 8 does not match the 6 devices"):
        mesh_shape(6, 4, 2)


def test_every_param_is_dim0_sharded_over_all_devices_with_fsdp2_padding():
    # sizes chosen not to divide by 6: vocab 1003, hidden 100, FFN 250, kv rows 2*25
    cfg = preset_config("qwen2", "tiny", vocab_size=1003, hidden_size=100, intermediate_size=250,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=25,
                        num_hidden_layers=2)
    mesh = make_mesh(3, 2)
    model = shard_model(QwenForCausalLM(cfg, rngs=nnx.Rngs(0), pad_multiple=6), mesh)
    expected = NamedSharding(mesh, P(("fsdp", "sp")))
    shapes = param_shapes(cfg)
    params = named_params(model)
    assert set(params) == set(shapes)
    for name, shape in shapes.items():
        arr = params[name][...]
        assert arr.sharding == expected, name
        c = -(-shape[0] // 6)
        assert arr.shape[0] == 6 * c
        shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start)
        assert len({s.device for s in shards}) == 6
        for r, s in enumerate(shards):
            assert s.data.shape == (c, *shape[1:]), name
            assert s.index[0] == slice(r * c, (r + 1) * c)
        # padding rows hold exact zeros
        assert not np.asarray(arr[shape[0]:]).any(), name


def test_per_device_bytes_of_params_and_adam_fall_to_a_sixth(tiny_hf):
    mesh = make_mesh(3, 2)
    model = load_hf(tiny_hf["qwen2"], mesh=mesh)
    shapes = param_shapes(model.cfg)
    total = sum(int(np.prod(s)) * 4 * 3 for s in shapes.values())  # params + mu + nu, fp32
    per_device = {d: 0 for d in mesh.devices.flat}
    for name, var in named_params(model).items():
        for s in var[...].addressable_shards:
            per_device[s.device] += s.data.nbytes * 3
    pad_allowance = sum(int(np.prod(s[1:])) * 4 * 3 for s in shapes.values())
    assert max(per_device.values()) <= 1.05 * total / 6 + pad_allowance
    report = layout_report(param_shapes(model.cfg), 6, {"fsdp": 3, "sp": 2})
    assert report["total_bytes"] == total
    assert report["max_device_bytes"] == max(per_device.values())


def _batch(vocab):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (3, 15)).astype(np.int32)  # 3 rows over fsdp=6, 15 tokens over sp=2
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 12:] = 0  # right padding
    return ids, mask


def _loss_and_grads(hf_dir, mesh_dims, ids, mask):
    if mesh_dims is None:
        model, mesh = load_hf(hf_dir), None
    else:
        n = mesh_dims[0] * mesh_dims[1]
        mesh = make_mesh(*mesh_dims, devices=jax.devices()[:n])
        model = load_hf(hf_dir, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"ids": ids, "mask": mask}
    if mesh is not None:
        batch = shard_batch(pad_batch(batch, mesh), mesh)

    @jax.jit
    def loss_fn(params, ids, mask):
        def f(p):
            m = nnx.merge(graphdef, p)
            logits = m(ids, mask)[:, :-1]
            logp = jax.nn.log_softmax(logits, -1)
            ll = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
            w = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
            return -(ll * w).sum() / w.sum(), logits
        (loss, logits), g = jax.value_and_grad(f, has_aux=True)(params)
        return loss, logits, g

    if mesh is None:
        loss, logits, grads = loss_fn(params, jnp.asarray(ids), jnp.asarray(mask))
    else:
        with jax.set_mesh(mesh):
            loss, logits, grads = loss_fn(params, batch["ids"], batch["mask"])
    flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(grads)}
    b, t = ids.shape
    return float(loss), np.asarray(logits)[:b, : t - 1], flat


@pytest.fixture(scope="module")
def mesh_results(tiny_hf):
    ids, mask = _batch(1003)
    return ids, mask, {dims: _loss_and_grads(tiny_hf["qwen3"], dims, ids, mask) for dims in MESHES}


@pytest.mark.parametrize("dims", MESHES[:3])
def test_forward_and_gradients_do_not_depend_on_the_mesh(mesh_results, dims):
    ids, mask, results = mesh_results
    ref_loss, ref_logits, ref_grads = results[None]
    loss, logits, grads = results[dims]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    real = (mask[:, :-1]).astype(bool)
    rel = np.abs(logits - ref_logits)[real].max() / np.abs(ref_logits[real]).max()
    assert rel <= 1e-5
    for name, g_ref in ref_grads.items():
        n = g_ref.shape[0]
        g = grads[name]
        assert np.abs(g[:n] - g_ref).max() <= 1e-5 * max(np.abs(g_ref).max(), 1e-12) + 1e-9, name
        assert not g[n:].any(), f"{name}: padding rows got a gradient"


def test_layers_gather_weights_just_in_time():
    """Compiled grad step on the 3 x 2 mesh: temporary memory per device stays well below one
    full replica of the weights, and grows by far less than a gathered layer per extra layer."""
    temps = {}
    for layers in (2, 8):
        cfg = preset_config("qwen3", "tiny", vocab_size=1003, num_hidden_layers=layers,
                            hidden_size=384, intermediate_size=1536, num_attention_heads=6,
                            num_key_value_heads=2)
        mesh = make_mesh(3, 2)
        model = shard_model(QwenForCausalLM(cfg, rngs=nnx.Rngs(0), pad_multiple=6, remat=True), mesh)
        graphdef, params = nnx.split(model, nnx.Param)
        full_bytes = sum(v[...].nbytes for _, v in nnx.to_flat_state(params))
        batch = shard_batch(pad_batch({"ids": np.zeros((6, 32), np.int32),
                                       "mask": np.ones((6, 32), np.int32)}, mesh), mesh)
        f = lambda p, i, m: nnx.merge(graphdef, p)(i, m).mean()  # noqa: E731
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(f), out_shardings=jax.tree.map(lambda v: v.sharding, params)
                               ).lower(params, batch["ids"], batch["mask"]).compile()
        temps[layers] = (compiled.memory_analysis().temp_size_in_bytes, full_bytes)
    temp8, full8 = temps[8]
    temp2, full2 = temps[2]
    layer_bytes = (full8 - full2) / 6
    assert temp8 < 0.75 * full8, temps
    assert (temp8 - temp2) / 6 < 0.5 * layer_bytes, temps


def test_kv_cache_decode_on_the_mesh_matches_unsharded(tiny_hf):
    from jscenegen.model.qwen import KVCache

    ids, mask = _batch(1003)
    ref = np.asarray(load_hf(tiny_hf["qwen2"])(jnp.asarray(ids), jnp.asarray(mask)))
    mesh = make_mesh(3, 2)
    model = load_hf(tiny_hf["qwen2"], mesh=mesh)
    batch = pad_batch({"ids": ids, "mask": mask}, mesh, seq_multiple=1)
    cache = KVCache.create(model.cfg, batch=batch["ids"].shape[0], max_len=16)
    step = nnx.jit(lambda m, i, k, c: m(i, k, c))
    outs = []
    with jax.set_mesh(mesh):
        prompt = 10
        placed = shard_batch({"ids": batch["ids"][:, :prompt], "mask": batch["mask"][:, :prompt]}, mesh)
        logits, cache = step(model, placed["ids"], placed["mask"], cache)
        outs.append(np.asarray(logits))
        for t in range(prompt, ids.shape[1]):
            logits, cache = step(model, jnp.asarray(batch["ids"][:, t:t + 1]),
                                 jnp.asarray(batch["mask"][:, t:t + 1]), cache)
            outs.append(np.asarray(logits))
    inc = np.concatenate(outs, axis=1)[: ids.shape[0]]
    real = mask.astype(bool)
    np.testing.assert_allclose(inc[real], ref[real], atol=2e-5, rtol=1e-5)


def test_causal_load_balanced_order_gives_the_same_logits(tiny_hf):
    from jscenegen.model.qwen import balanced_order

    order = balanced_order(16, 2)
    assert sorted(order) == list(range(16))
    # shard 0 of 2 holds chunks 0 and 3, shard 1 chunks 1 and 2 (4 tokens each)
    np.testing.assert_array_equal(order[:8], [0, 1, 2, 3, 12, 13, 14, 15])
    ids, mask = _batch(1003)
    ref = np.asarray(load_hf(tiny_hf["qwen3"])(jnp.asarray(ids), jnp.asarray(mask)))
    mesh = make_mesh(3, 2)
    model = load_hf(tiny_hf["qwen3"], mesh=mesh, causal_balance=True)
    assert model.balance_shards == 2
    batch = shard_batch(pad_batch({"ids": ids, "mask": mask}, mesh, seq_multiple=4), mesh)
    with jax.set_mesh(mesh):
        logits = np.asarray(jax.jit(lambda i, m: model(i, m))(batch["ids"], batch["mask"]))
    real = mask.astype(bool)
    np.testing.assert_allclose(logits[:3, :15][real], ref[real], atol=2e-5, rtol=1e-5)
