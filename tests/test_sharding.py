"""FSDP2-style parameter sharding and sequence parallelism on real 6-device CPU meshes."""
import contextlib
import re
import textwrap

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
from jscenegen.sharding.hlo import collectives
from jscenegen.sharding.layout import layout_report, pad_batch, shard_batch, shard_model
from jscenegen.sharding.mesh import MeshError, make_mesh, mesh_shape

MESHES = [(3, 2), (6, 1), (1, 2), None]


def test_mesh_shape_resolution_and_errors():
    assert mesh_shape(6, -1, 2) == (3, 2)
    assert mesh_shape(6, 6, 1) == (6, 1)
    with pytest.raises(MeshError, match="mesh.sp=4 does not divide the 6 devices"):
        mesh_shape(6, -1, 4)
    with pytest.raises(MeshError, match="mesh.fsdp=4 x mesh.sp=2 = 8 does not match the 6 devices"):
        mesh_shape(6, 4, 2)
    # eval and design name the keys as train does (they had "mesh sizes must be positive")
    with pytest.raises(MeshError, match=r"^mesh.fsdp=0, mesh.sp=2: mesh sizes must be positive"):
        mesh_shape(6, 0, 2)


@pytest.mark.parametrize("env, why", [
    ({"JSCENEGEN_NUM_PROCESSES": "two"},
     "multi-host launch: environment variable JSCENEGEN_NUM_PROCESSES='two' is not an integer"),
    ({"JSCENEGEN_NUM_PROCESSES": "\uff12"}, "JSCENEGEN_NUM_PROCESSES='\uff12' is not an integer"),
    ({"JSCENEGEN_PROCESS_ID": "2"},
     "JSCENEGEN_PROCESS_ID=2 must lie in 0..1 (JSCENEGEN_NUM_PROCESSES=2)"),
    ({"JSCENEGEN_PROCESS_ID": "-1"}, "JSCENEGEN_PROCESS_ID=-1 must lie in 0..1"),
    ({"JSCENEGEN_COORDINATOR": "host0"}, "JSCENEGEN_COORDINATOR='host0' is not host:port"),
    ({"JSCENEGEN_COORDINATOR": "host0:99999"},
     "JSCENEGEN_COORDINATOR='host0:99999': the port must lie in 1..65535"),
    ({"JSCENEGEN_COORDINATOR": "host0:0"}, "JSCENEGEN_COORDINATOR='host0:0': the port must lie in 1..65535"),
    ({"JSCENEGEN_COORDINATOR": "host0:\uff18\uff14"},   # full-width digits are no port
     "JSCENEGEN_COORDINATOR='host0:\uff18\uff14' is not host:port"),
    ({"JSCENEGEN_NUM_PROCESSES": "0"}, "JSCENEGEN_NUM_PROCESSES=0 must lie in 1..1,048,576"),
    # JAX's own argument check failed on it after the announced wait (a TypeError)
    ({"JSCENEGEN_NUM_PROCESSES": "9" * 23},
     f"JSCENEGEN_NUM_PROCESSES={'9' * 23} must lie in 1..1,048,576"),
    ({"JSCENEGEN_NUM_PROCESSES": "1", "JSCENEGEN_PROCESS_ID": "7"},
     "JSCENEGEN_PROCESS_ID=7 must lie in 0..0"),
    ({"JSCENEGEN_COORDINATOR": "nosuchhost.invalid:8476"},
     "the coordinator host 'nosuchhost.invalid' (JSCENEGEN_COORDINATOR) does not resolve"),
    # JAX waited out the whole timeout for these, both processes saying only "did not all join"
    ({"JSCENEGEN_COORDINATOR": "::1:8476"},
     "JSCENEGEN_COORDINATOR='::1:8476': an IPv6 host is written in brackets ([::1]:8476)"),
    ({"JSCENEGEN_COORDINATOR": "[127.0.0.1]:8476"},
     "JSCENEGEN_COORDINATOR='[127.0.0.1]:8476': an IPv6 host is written in brackets ([::1]:8476), "
     "and only an IPv6 host"),
])
def test_a_multi_host_launch_is_checked_before_jax_waits_for_other_processes(monkeypatch, env, why):
    """jax.distributed.initialize would wait minutes for processes that can never join."""
    from jscenegen.sharding.mesh import initialize_distributed

    for key, value in {"JSCENEGEN_COORDINATOR": "host0:8476", "JSCENEGEN_NUM_PROCESSES": "2",
                       "JSCENEGEN_PROCESS_ID": "1", **env}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(MeshError, match=re.escape(why)):
        initialize_distributed()


def test_launch_values_from_the_config_are_named_by_their_keys(monkeypatch):
    from jscenegen.sharding.mesh import initialize_distributed

    monkeypatch.delenv("JSCENEGEN_COORDINATOR", raising=False)
    with pytest.raises(MeshError, match=re.escape("mesh.process_id=3 must lie in 0..1 "
                                                  "(mesh.num_processes=2)")):
        initialize_distributed("host0:8476", 2, 3)


def test_process_0_refuses_a_coordinator_port_in_use(monkeypatch):
    """JAX reported a busy port as "the processes did not all join" after the full wait."""
    import socket

    from jscenegen.sharding.mesh import initialize_distributed

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MeshError, match=re.escape(
                f"port {port} of mesh.coordinator_address is in use on this host, where process 0 "
                "serves the coordinator (by another program, or by a process 0 already started: "
                "each process needs its own JSCENEGEN_PROCESS_ID); choose a free port")):
            initialize_distributed(f"127.0.0.1:{port}", 2, 0, timeout_s=1)


def test_process_0_refuses_a_coordinator_port_an_ipv6_listener_holds():
    import socket

    from jscenegen.sharding.mesh import initialize_distributed

    with socket.socket(socket.AF_INET6) as busy:
        busy.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MeshError, match=f"port {port} of mesh.coordinator_address is in use"):
            initialize_distributed(f"127.0.0.1:{port}", 2, 0, timeout_s=1)


def test_every_param_is_dim0_sharded_over_all_devices_with_fsdp2_padding():
    # sizes chosen not to divide by 6: vocab 1003, hidden 100, FFN 250, kv rows 2*26 (head_dim must be even: RoPE)
    cfg = preset_config("qwen2", "tiny", vocab_size=1003, hidden_size=100, intermediate_size=250,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=26,
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


@pytest.mark.parametrize("selected", [False, True])
def test_layers_gather_weights_just_in_time(selected):
    """Compiled grad step on the 3 x 2 mesh: temporary memory per device stays well below one
    full replica of the weights, and grows by far less than a gathered layer per extra layer;
    also when the last layer runs on selected positions outside the scan (`rows=`)."""
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
        rows = jnp.tile(jnp.arange(0, 32, 2, dtype=jnp.int32), (batch["ids"].shape[0], 1))

        def f(p, i, m):
            model = nnx.merge(graphdef, p)
            if not selected:
                return model(i, m).mean()
            return model.logits(model.hidden_states(i, m, rows=rows)).mean()
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
    # selected positions (the train step's rows=) name the original order, not the balanced
    # one; a count the sp axis does not divide (5) and a single position
    with jax.set_mesh(mesh):
        full = np.asarray(jax.jit(lambda i, m: model.hidden_states(i, m))(batch["ids"], batch["mask"]))
        for picked in ([14, 0, 7, 3, 11, 15, 8, 1], [9, 2, 15, 0, 6], [13]):
            rows = np.tile(np.array([picked], np.int32), (batch["ids"].shape[0], 1))
            sel = np.asarray(jax.jit(lambda i, m, r: model.hidden_states(i, m, rows=r))(
                batch["ids"], batch["mask"], jnp.asarray(rows)))
            np.testing.assert_allclose(sel, np.take_along_axis(full, rows[..., None], axis=1),
                                       atol=2e-5, rtol=1e-5)


def test_the_balanced_order_program_holds_no_constant_that_grows_with_the_sequence():
    """model.causal_balance builds its order from an iota and compares it in the program: the
    lowered forward grows by less than one character per position from S = 256 to 1024 (only
    the shapes' digits), where an [S] constant would add several per position and the former
    folded [S, S] mask constant added 2.0 MB (134 MB of StableHLO at S = 8,192)."""
    cfg = preset_config("qwen3", "micro", vocab_size=256, num_hidden_layers=1)
    model = QwenForCausalLM(cfg, rngs=nnx.Rngs(0), balance_shards=2, scan_layers=False)
    forward = nnx.jit(lambda m, i, k: m.hidden_states(i, k))
    size = {s: len(forward.lower(model, jnp.zeros((1, s), jnp.int32),
                                 jnp.ones((1, s), jnp.int32)).as_text()) for s in (256, 1024)}
    assert size[1024] - size[256] < 1024 - 256, size


# ---- Qwen3.5: every tensor and both Adam moments, and sequence parallelism through the GDN ----
def _shards_follow_fsdp2(arr, logical_rows: int, mesh, name: str) -> None:
    """arr is split on dim 0 over all devices, FSDP2-padded: device r holds rows [r c, (r+1) c)."""
    c = -(-logical_rows // mesh.size)
    assert arr.sharding == NamedSharding(mesh, P(("fsdp", "sp"))), name
    assert arr.shape[0] == mesh.size * c, name
    shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start)
    assert len({s.device for s in shards}) == mesh.size, name
    for r, s in enumerate(shards):
        assert s.data.shape == (c, *arr.shape[1:]) and s.index[0] == slice(r * c, (r + 1) * c), name
    assert not np.asarray(arr[logical_rows:]).astype(np.float32).any(), f"{name}: padding not zero"


def test_qwen35_params_carried_tensors_and_adam_moments_are_fsdp2_sharded(qwen35_hf):
    """A_log/dt_bias [H_v], conv1d.weight [C, 1, K], in_proj_*, the gated q_proj, norms, the
    carried vision tower and mtp.* (bf16 kept) and both Adam moments of every trainable one."""
    from jscenegen.grpo.algo.config import OptimConfig
    from jscenegen.grpo.algo.optimizer import adam_state, init_train_state
    from jscenegen.model.functional import split_params
    from jscenegen.model.weights import Carried, named_leaves, named_weights

    mesh = make_mesh(3, 2)
    model = load_hf(qwen35_hf["release"], mesh=mesh)  # bf16 storage: carried stay bf16
    shapes = param_shapes(model.cfg, carried=True)
    weights = named_weights(model)
    assert set(weights) == set(shapes)
    kinds = {"A_log": 0, "dt_bias": 0, "conv1d.weight": 0, "in_proj_qkv": 0, "in_proj_a": 0,
             "self_attn.q_proj": 0, "model.visual.": 0, "mtp.": 0}
    for name, var in weights.items():
        _shards_follow_fsdp2(var[...], shapes[name][0], mesh, name)
        assert (var[...].dtype == np.dtype("bfloat16")) == isinstance(var, Carried), name
        for k in kinds:
            kinds[k] += k in name
    assert all(kinds.values()), kinds
    assert shapes["model.language_model.layers.0.linear_attn.A_log"] == (4,)  # 4 -> 6 rows
    _, params, _ = split_params(model)
    state = init_train_state(params, OptimConfig())  # as the trainer builds it
    moments = adam_state(state.opt_state)
    trained = named_leaves(state.params)
    assert set(trained) == set(param_shapes(model.cfg))  # no Adam state for carried tensors
    for group in (named_leaves(moments.mu), named_leaves(moments.nu)):
        assert set(group) == set(trained)
        for name, arr in group.items():
            assert arr.dtype == np.float32
            _shards_follow_fsdp2(arr, shapes[name][0], mesh, name)


# A 2-layer Qwen3.5 (one Gated DeltaNet layer, one gated attention layer, a carried vision
# tower), small enough to compile on four meshes; every width distinct (hidden 44, conv 128,
# H_v d_v 80, H_v d_k 48, K/V 32, vocab 389) so the HLO test can tell the arrays apart. Weights
# drawn as tests/qwen35_fixtures.py draws them (no parameter trivially 0 or 1; decays in (0.05, 1)).
QWEN35_SMALL = dict(vocab_size=389, num_hidden_layers=2, hidden_size=44, intermediate_size=70,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
                    linear_value_head_dim=20, full_attention_interval=2,
                    layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def qwen35_small():
    """(config, {hf_name: np.ndarray}) of the 2-layer Qwen3.5 above."""
    from jscenegen.model.config import preset_config
    from jscenegen.model.weights import weight_table

    overrides = dict(QWEN35_SMALL)
    cfg = preset_config("qwen3_5", "micro", vocab_size=overrides.pop("vocab_size"), **overrides)
    rng = np.random.default_rng(7)
    arrays = {}
    for name, spec in weight_table(cfg).items():
        noise = rng.standard_normal(spec.shape).astype(np.float32)
        if name.endswith("A_log"):
            arrays[name] = np.log(rng.uniform(0.05, 1.0, spec.shape)).astype(np.float32)
        elif name.endswith("dt_bias"):
            arrays[name] = 0.5 * noise
        elif name.endswith("linear_attn.norm.weight"):
            arrays[name] = 1.0 + 0.3 * noise
        elif "norm" in name and "visual" not in name:
            arrays[name] = 0.3 * noise
        elif name.endswith("conv1d.weight"):
            arrays[name] = 0.4 * noise
        else:
            arrays[name] = 0.08 * noise
    return cfg, arrays


# Rows of 21 tokens (padded to 22 for sp = 2, 21 for sp = 3): row 1 has 2 real tokens in the
# first sp = 2 shard (the conv state entering shard 1 mixes zeros and them), row 2 is right-
# padded, row 3's first shard holds no real token.
def _qwen35_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 389, (4, 21)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :9] = 0
    mask[2, 17:] = 0
    mask[3, :12] = 0
    return ids, mask


def _grad_program(graphdef, frozen):
    def loss_fn(params, ids, mask):
        def f(p):
            logits = nnx.merge(graphdef, p, frozen)(ids, mask)[:, :-1]
            ll = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, 1:, None], -1)[..., 0]
            w = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
            return -(ll * w).sum() / w.sum(), logits
        (loss, logits), g = jax.value_and_grad(f, has_aux=True)(params)
        return loss, logits, g
    return jax.jit(loss_fn)


_QWEN35_RUNS: dict = {}


def _qwen35_run(small, dims):
    """(loss, logits [4, 20], {name: grad}, compiled HLO text or None) of one mesh, memoised."""
    from jscenegen.model.functional import split_params
    from jscenegen.model.loader import build_model
    from jscenegen.model.weights import named_leaves

    if dims in _QWEN35_RUNS:
        return _QWEN35_RUNS[dims]
    cfg, arrays = small
    ids, mask = _qwen35_batch()
    if dims is None:
        graphdef, params, frozen = split_params(build_model(cfg, arrays.items()))
        loss, logits, grads = _grad_program(graphdef, frozen)(params, ids, mask)
        hlo = None
    else:
        mesh = make_mesh(*dims, devices=jax.devices()[: dims[0] * dims[1]])
        graphdef, params, frozen = split_params(build_model(cfg, arrays.items(), mesh=mesh))
        batch = shard_batch(pad_batch({"ids": ids, "mask": mask}, mesh), mesh)
        with jax.set_mesh(mesh):
            compiled = _grad_program(graphdef, frozen).lower(params, batch["ids"],
                                                             batch["mask"]).compile()
            loss, logits, grads = compiled(params, batch["ids"], batch["mask"])
        hlo = compiled.as_text()
    out = (float(loss), np.asarray(logits)[:4, :20],
           {n: np.asarray(g) for n, g in named_leaves(grads).items()}, hlo)
    _QWEN35_RUNS[dims] = out
    return out


@pytest.mark.parametrize("dims", [(3, 2), (1, 2),
                                  pytest.param((6, 1), marks=pytest.mark.slow),
                                  pytest.param((2, 3), marks=pytest.mark.slow)])
def test_qwen35_logits_and_gradients_do_not_depend_on_the_mesh(qwen35_small, dims):
    """Context-parallel Gated DeltaNet (sp = 2, 3), FSDP only (6 x 1) vs one device: fp32
    relative 1e-5 on logits and every gradient; padding rows of every parameter get none."""
    ids, mask = _qwen35_batch()
    ref_loss, ref_logits, ref_grads, _ = _qwen35_run(qwen35_small, None)
    loss, logits, grads, _ = _qwen35_run(qwen35_small, dims)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    real = mask[:, :-1].astype(bool)
    assert np.abs(logits - ref_logits)[real].max() <= 1e-5 * np.abs(ref_logits[real]).max()
    assert set(grads) == set(ref_grads)
    for name, g_ref in ref_grads.items():
        n, g = g_ref.shape[0], grads[name]
        assert np.abs(g[:n] - g_ref).max() <= 1e-5 * max(np.abs(g_ref).max(), 1e-12) + 1e-9, name
        assert not g[n:].any(), f"{name}: padding rows got a gradient"


def test_qwen35_selected_positions_on_the_mesh_equal_the_full_forward(qwen35_small):
    """The train step's path (`model_token_logprobs` with a capacity: the last layer, gated
    attention here, runs after the scan at the selected positions only) on the 3 x 2 mesh
    (sequence split over sp, rows over fsdp): log-probs and gradients equal the full forward's
    on one device, fp32 relative 1e-5."""
    from jscenegen.grpo.algo.logprobs import model_token_logprobs
    from jscenegen.model.functional import hidden_fn, split_params
    from jscenegen.model.loader import build_model
    from jscenegen.model.weights import named_leaves

    cfg, arrays = qwen35_small
    assert cfg.kinds[-1] == "full_attention"
    ids, mask = _qwen35_batch()
    select = (np.random.default_rng(1).random(ids.shape) < 0.4) & mask.astype(bool)
    select[:, 0] = False
    select[:, 1:] &= mask[:, :-1].astype(bool)   # a trained token follows a real one (padding's
    select = select.astype(np.float32)           # states depend on the mesh)
    assert 0 < select.sum(1).max() <= 16

    def run(dims, capacity):
        mesh = None if dims is None else make_mesh(*dims, devices=jax.devices()[:6])
        graphdef, params, frozen = split_params(build_model(cfg, arrays.items(), mesh=mesh))
        fn = hidden_fn(graphdef, frozen)

        def loss(p, i, m, s):
            lp, _ = model_token_logprobs(fn, p, i, m, select=s, capacity=capacity)
            return jnp.sum(lp * s), lp

        batch = {"ids": ids, "mask": mask, "select": select}
        if mesh is not None:
            batch = shard_batch(pad_batch(batch, mesh), mesh)
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            (_, lp), grads = step(params, batch["ids"], batch["mask"], batch["select"])
        lp = np.asarray(lp)[:4, :21] * select   # with a capacity the others are not computed
        return lp, {n: np.asarray(g) for n, g in named_leaves(grads).items()}

    ref_lp, ref_grads = run(None, None)
    for dims in (None, (3, 2)):
        lp, grads = run(dims, 16)
        assert np.abs(lp - ref_lp).max() <= 1e-5 * np.abs(ref_lp).max(), dims
        for name, g_ref in ref_grads.items():
            n = g_ref.shape[0]
            assert np.abs(grads[name][:n] - g_ref).max() <= 1e-5 * max(np.abs(g_ref).max(), 1e-12) + 1e-9, (dims, name)


def _sp_collectives(hlo: str, sp: int) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array a collective over groups of `sp` devices returns
    (tuple results: each element)."""
    return [shape for c in collectives(hlo) if c.group_size == sp for shape in c.shapes]


def test_qwen35_gdn_layers_do_not_gather_the_sequence_over_sp(qwen35_small):
    """The compiled 3 x 2 forward + backward: collectives over the sp pairs carry the
    attention layer's K/V (and its key mask and positions, and the test loss's shifted
    logits) over the sequence, and for the Gated DeltaNet layers only per-row summaries: conv tails [sp, rows, C, K-1], counts, and
    the state maps [sp, rows, H_v, d_k, d_k] / [sp, rows, H_v, d_k, d_v] (forward gathers,
    backward reduce-scatters). No float collective over sp has a [rows, S, width] shape
    with a GDN or hidden width: the sequence is never replicated per sp shard."""
    cfg = qwen35_small[0]
    *_, hlo = _qwen35_run(qwen35_small, (3, 2))
    s, rows = 22, 2                                # padded length; rows per fsdp shard
    kv = cfg.num_key_value_heads * cfg.head_dim
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    found = _sp_collectives(hlo, 2)
    widths = {int(np.prod(sh)) // (rows * s) for t, sh in found if t == "f32" and s in sh}
    assert kv in widths, f"the parser must see the attention layer's K/V gather: {found}"
    # the GDN's input, conv channels, q/k/v heads, gates: none crosses sp over the sequence
    # (the gathered design moved [rows, S, hidden] per layer, and back in the backward pass)
    gdn = {cfg.hidden_size, cfg.conv_dim, hv * dv, hv * dk, hv}
    assert not widths & gdn, (widths, gdn)
    maps = {sh[-3:] for t, sh in found if t == "f32" and s not in sh}
    assert (hv, dk, dk) in maps and (hv, dk, dv) in maps, maps
    assert (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1) in {m[-2:] for m in maps}, maps


def test_an_async_collective_counts_the_bytes_it_produces_not_the_operands_it_carries():
    """GPU HLO's async all-gather and collective-permute return (operands, results, context
    scalars): the operands were counted too (640 bytes for this all-gather of 512); a combined
    all-reduce-start returns its results alone (192 bytes, all counted)."""
    hlo = textwrap.dedent("""\
        ENTRY %main (p: f32[4,8]) -> f32[16,8] {
          %p = f32[4,8]{1,0} parameter(0)
          %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
          %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1}}
          %ars = (f32[4,8]{1,0}, f32[16]{0}) all-reduce-start(%p, %q), replica_groups={{0,1}}, to_apply=%add
          ROOT %agd = f32[16,8]{1,0} all-gather-done(%ags)
        }
        """)
    found = {c.op: (c.shapes, c.bytes, c.group_size) for c in collectives(hlo)}
    assert found == {"all-gather": ((("f32", (16, 8)),), 512, 4),
                     "collective-permute": ((("f32", (4, 8)),), 128, None),
                     "all-reduce": ((("f32", (4, 8)), ("f32", (16,))), 192, 2)}
