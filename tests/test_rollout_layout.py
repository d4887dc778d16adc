"""Rollout layouts (sharding/rollout.py, generate/reshard.py) on the 3 x 2 mesh: the choice,
where the resharded weights live, the same samples as the unsharded sampler in every layout,
the compiled decode loop's collectives (no weight bytes per token), and one reshard per step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jscenegen.generate.sampler import Sampler
from jscenegen.generate.sampling import SamplingParams
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.train.step import GRPOStep
from jscenegen.model.functional import hidden_fn
from jscenegen.model.hf_io import load_hf
from jscenegen.model.weights import (
    group_channel_blocks,
    named_leaves,
    param_shapes,
    split_channel_blocks,
)
from jscenegen.sharding.hlo import loop_collectives
from jscenegen.sharding.mesh import make_mesh
from jscenegen.sharding.rollout import choose_rollout_layout, tp_candidates
from jscenegen.sharding.rules import rollout_kind

LAYOUTS = ("replicated", "tp", "fsdp")
BUCKETS = (16, 32)
ROWS = 6           # a multiple of every layout's data-parallel size on 3 x 2 (6, 3, 3)
NEW = 8
GiB = 2 ** 30


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(3, 2)


@pytest.fixture(scope="module")
def trained(tiny_hf, mesh):
    """The tiny Qwen2 (q/k/v biases, untied head) and Qwen3 (q/k norms, tied) in the training
    layout (FSDP2 shards, padded) and unsharded."""
    return {arch: (load_hf(tiny_hf[arch], mesh=mesh), load_hf(tiny_hf[arch])) for arch in tiny_hf}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 1003, n).tolist() for n in (11, 5, 14, 3, 9, 7)]


@functools.cache
def _sampler(model, layout, greedy, mesh=None):
    params = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=0.9, top_k=40)
    return Sampler(model, params, buckets=BUCKETS, mesh=mesh, layout=layout)


@pytest.mark.parametrize("mesh_or_none", ["mesh", None])
def test_an_unknown_layout_is_refused_with_or_without_a_mesh(mesh, mesh_or_none):
    with pytest.raises(ValueError, match="rollout.layout must be auto, replicated, tp or fsdp"):
        choose_rollout_layout(mesh if mesh_or_none else None, "pipeline", weight_bytes=GiB,
                              divides=(2, 4, 96), device_bytes=8 * GiB, platform="cpu")


@pytest.mark.parametrize("peer", [2 * GiB, None])
def test_every_process_judges_memory_by_the_least_device_of_the_run(monkeypatch, peer):
    """Each process read its own device memory: hosts with different memory (or cgroup limits)
    chose different rollout layouts, or one alone refused a cache, and then waited in other
    collectives than their peers. Here a peer process (the patched `max_over_processes`) has
    2 GiB per device or cannot tell."""
    import jscenegen.sharding.rollout as rollout

    own = 8 * GiB + 12345
    monkeypatch.setattr(rollout, "device_memory_bytes", lambda device=None: own)
    monkeypatch.setattr(rollout.jax, "process_count", lambda: 2)
    peer_says = [1 if peer is None else 0, None if peer is None else -(peer // 2**20)]

    def peers_max(value):
        return max(value, peer_says.pop(0))

    monkeypatch.setattr(rollout, "max_over_processes", peers_max)
    assert rollout.least_device_memory_bytes() == peer
    monkeypatch.setattr(rollout.jax, "process_count", lambda: 1)
    assert rollout.least_device_memory_bytes() == own


def test_a_memory_no_process_can_tell_is_never_read_again_locally(mesh, monkeypatch):
    """`least_device_memory_bytes` said None (a peer cannot tell) and the layout choice took
    None for "not given" and read this process's memory: 8 GiB here chose tp, the peer
    replicated."""
    import jscenegen.sharding.rollout as rollout

    monkeypatch.setattr(rollout, "device_memory_bytes", lambda device=None: 8 * GiB)
    unknown = choose_rollout_layout(mesh, "auto", weight_bytes=4 * GiB, divides=(2, 4, 96),
                                    device_bytes=None, platform="gpu")
    assert (unknown.name, unknown.reason) == ("replicated", "device memory unknown")
    local = choose_rollout_layout(mesh, "auto", weight_bytes=4 * GiB, divides=(2, 4, 96),
                                  platform="gpu")
    assert (local.name, local.tp) == ("tp", 2)


def test_auto_picks_replicated_when_the_weights_fit_else_the_smallest_tp(mesh):
    heads = (2, 4, 96)                                    # kv heads, heads, FFN of the fixture
    lay = choose_rollout_layout(mesh, "auto", weight_bytes=GiB, divides=heads,
                                device_bytes=8 * GiB, platform="cpu")
    assert (lay.name, lay.tp, lay.row_multiple) == ("replicated", 1, 6)
    assert dict(lay.mesh.shape) == {"data": 6, "tp": 1} and lay.transposed
    assert "1.00 GiB <= 0.25 x 8.0 GiB" in lay.reason
    assert list(lay.mesh.devices.flat) == list(mesh.devices.flat)   # same devices, same order
    lay = choose_rollout_layout(mesh, "auto", weight_bytes=3 * GiB, divides=heads,
                                device_bytes=8 * GiB, platform="gpu")
    assert (lay.name, lay.tp, lay.row_multiple, lay.transposed) == ("tp", 2, 3, False)
    assert "> 0.25 x device memory" in lay.reason
    # nothing fits: the largest tensor size the heads allow
    lay = choose_rollout_layout(mesh, "auto", weight_bytes=64 * GiB, divides=heads,
                                device_bytes=8 * GiB)
    assert lay.tp == 2 and tp_candidates(6, heads) == [1, 2]
    assert choose_rollout_layout(mesh, "fsdp", weight_bytes=1).row_multiple == 3
    assert choose_rollout_layout(None, "tp", weight_bytes=1).name == "replicated"
    for choice in ("tp", "auto"):
        with pytest.raises(ValueError, match="rollout.tp=3 must divide the 6 devices and"):
            choose_rollout_layout(mesh, choice, weight_bytes=1, divides=heads, tp=3)
    # a layout that reads no tp is not refused for one it would not use
    assert choose_rollout_layout(mesh, "replicated", weight_bytes=1, divides=heads, tp=3).tp == 1
    with pytest.raises(ValueError, match="no tensor size > 1"):
        choose_rollout_layout(mesh, "tp", weight_bytes=1, divides=(1,))


@pytest.mark.parametrize("layout", ["replicated", "tp"])
def test_resharded_weights_are_unpadded_in_their_layout_and_training_arrays_untouched(
        trained, mesh, layout):
    model, _ = trained["qwen2"]
    before = {n: (v.sharding, np.asarray(v)) for n, v in named_leaves(nnx.split(model)[1]).items()}
    s = _sampler(model, layout, True, mesh)
    shapes = param_shapes(model.cfg)
    rollout = named_leaves(s.state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert set(rollout) == set(shapes)
    expected_bytes = 0
    for name, var in rollout.items():
        arr, meta = var[...], var.get_metadata()
        kind, transposable = rollout_kind(name)
        transposed = transposable and len(shapes[name]) == 2      # XLA:CPU reads [in, out]
        assert meta.get("transposed", False) == transposed, name
        assert arr.shape == (shapes[name][::-1] if transposed else shapes[name]), name
        spec = arr.sharding.spec
        if layout == "replicated" or kind == "whole" or (kind == "vocab" and shapes[name][0] % 2):
            assert spec == P(), (name, spec)                 # vocab 1003 does not split in two
        else:
            split = 1 if kind == "row" else 0
            assert spec == P(*[None] * (1 - split if transposed else split), "tp"), (name, spec)
        per_device = {s.device: s.data for s in arr.addressable_shards}
        assert len(per_device) == 6
        expected_bytes += sum(d.nbytes for d in per_device.values())
        logical = np.asarray(arr).T if transposed else np.asarray(arr)
        np.testing.assert_array_equal(logical, before[name][1][: shapes[name][0]], err_msg=name)
    assert s.reshard_stats["reshard_bytes"] == expected_bytes
    for name, v in named_leaves(nnx.split(model)[1]).items():   # training arrays unchanged
        assert v.sharding == before[name][0]
        np.testing.assert_array_equal(np.asarray(v), before[name][1])


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_channel_blocks_grouped_by_shard_are_read_back_in_order(groups):
    """A `COLUMN_BLOCKS` weight ([q | k | v] rows) stored grouped by shard: an even split of
    its rows over `groups` devices gives device r the r-th part of every block, and the
    projection's output split back (`split_channel_blocks`) is the ungrouped weight's blocks."""
    blocks = (6, 6, 12)
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    grouped = np.asarray(group_channel_blocks(jnp.asarray(w), blocks, groups))
    starts = np.cumsum((0, *blocks))
    per = 24 // groups
    for r in range(groups):
        want = np.concatenate([w[a + r * (b - a) // groups: a + (r + 1) * (b - a) // groups]
                               for a, b in zip(starts[:-1], starts[1:])])
        np.testing.assert_array_equal(grouped[r * per:(r + 1) * per], want)
    x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
    parts = split_channel_blocks(jnp.asarray(x @ grouped.T), blocks, groups)
    for got, a, b in zip(parts, starts[:-1], starts[1:]):
        np.testing.assert_allclose(np.asarray(got), x @ w[a:b].T, rtol=1e-6)
    with pytest.raises(ValueError, match=r"blocks \(6, 6, 12\) must sum to dim 0 \(24\) "
                                         "and each split into 4 parts"):
        group_channel_blocks(jnp.asarray(w), blocks, 4)


@functools.cache
def _trainer_logprobs(model):
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    step = GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), OptimConfig(), temperature=0.9,
                    donate=False)
    return step, params


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_samples_the_unsharded_tokens(trained, mesh, prompts, layout, greedy):
    sharded, single = trained["qwen3"]
    seeds = list(range(40, 40 + ROWS))
    ref = _sampler(single, "auto", greedy).generate(prompts, NEW, seeds)
    out = _sampler(sharded, layout, greedy, mesh).generate(prompts, NEW, seeds)
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    np.testing.assert_allclose(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out["lengths"], ref["lengths"])
    if greedy:
        return
    # the trainer's recompute (unsharded, the train step's own program) agrees: drift ~ 0
    step, params = _trainer_logprobs(single)
    ids = np.zeros((ROWS, 32), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        seq = p + out["tokens"][i].tolist()
        ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    want = np.asarray(step.logprobs(params, jnp.asarray(ids), jnp.asarray(mask))[0])
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(out["logprobs"][i], want[i, len(p):len(p) + NEW], atol=1e-5)


def _loop_bytes(s: Sampler, rows: int) -> tuple[list, int]:
    """The collectives of the compiled decode loop and the bytes they move per step per device."""
    found = loop_collectives(s.decode_hlo(rows, 32, NEW))
    return found, sum(c.bytes for c in found)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_the_decode_loop_moves_no_weight_bytes(trained, mesh, arch):
    """Parse the compiled decode loop on the 3 x 2 mesh. replicated: nothing but the loop's
    `all rows done` flag crosses devices, greedy or with top-k (each device draws its own rows:
    a top-k over row-split logits made XLA gather every row's logits at each step). tp: per step at most two all-reduces of the local
    rows' hidden states per layer, one for the embedding lookup and a gather of the logits:
    (2 L + 1) x b x H x 4 + b x V x 4 bytes, b = rows / data. fsdp: the same parse finds the
    weight all-gathers: every layer's and the output head's bytes per step (the input embedding
    is looked up from its shards), so the check can fail."""
    model, _ = trained[arch]
    cfg = model.cfg
    weight_bytes = 4 * sum(int(np.prod(s)) for s in param_shapes(cfg).values())
    for greedy in (True, False):   # top-k sampling too: it all-gathered every row's logits
        found, moved = _loop_bytes(_sampler(model, "replicated", greedy, mesh), ROWS)
        assert moved <= 8 and all(c.shapes in ((("pred", ()),),) for c in found), found
    b = ROWS // 3
    bound = (2 * cfg.num_hidden_layers + 1) * b * cfg.hidden_size * 4 + b * cfg.vocab_size * 4 + 8
    found, moved = _loop_bytes(_sampler(model, "tp", False, mesh), ROWS)
    assert 0 < moved <= bound, (moved, bound, found)
    found, moved = _loop_bytes(_sampler(model, "tp", True, mesh), ROWS)
    assert 0 < moved <= bound, (moved, bound, found)
    assert moved < weight_bytes / 50
    assert not any(c.op == "all-gather" and c.bytes >= cfg.hidden_size * 16 for c in found), found
    found, moved = _loop_bytes(_sampler(model, "fsdp", True, mesh), ROWS)
    gathered = sum(c.bytes for c in found if c.op == "all-gather")
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 4
    assert gathered >= weight_bytes - lookup, (gathered, weight_bytes, lookup)


def test_qwen35_fsdp_decode_gathers_every_layer_kind_inside_the_loop(qwen35_hf, mesh):
    """Qwen3.5's layers run as a scan over stacked weights built once outside the decode
    loop; under `fsdp` those gathers stay in the loop too (the barrier covers the stack), so
    the loop's all-gathers hold at least the output head and one layer of each kind (the layer
    scan's body holds each gather once). Hoisted, they held the head and a part of one layer.
    `replicated` moves nothing but the loop's `all rows done` flag."""
    model = load_hf(qwen35_hf["qwen3_5"], mesh=mesh)
    shapes = param_shapes(model.cfg)

    def nbytes(prefix):
        return 4 * sum(int(np.prod(s)) for k, s in shapes.items() if k.startswith(prefix))

    kinds = model.cfg.kinds
    first = {kind: kinds.index(kind) for kind in ("linear_attention", "full_attention")}
    floor = nbytes("lm_head.") + sum(nbytes(f"model.language_model.layers.{i}.")
                                     for i in first.values())
    found, _ = _loop_bytes(_sampler(model, "fsdp", True, mesh), ROWS)
    gathered = sum(c.bytes for c in found if c.op == "all-gather")
    assert gathered >= floor, (gathered, floor)
    found, moved = _loop_bytes(_sampler(model, "replicated", True, mesh), ROWS)
    assert moved <= 8 and all(c.shapes in ((("pred", ()),),) for c in found), found


def test_a_reshard_that_does_not_fit_the_free_device_memory_is_refused_before_it_runs(
        trained, mesh, monkeypatch, caplog):
    """The rollout copy and XLA's temporaries (the gathered arrays in flight) were never
    compared with the devices' free memory: a large model ran out of memory mid-reshard."""
    model, _ = trained["qwen2"]

    def sampler():   # a new one (`_sampler` keeps those it made)
        return Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS, mesh=mesh,
                       layout="replicated")

    with caplog.at_level("INFO", logger="jscenegen.generate.sampler"):
        memory = sampler()._reshard.memory
    need = memory["output_bytes"] + memory["temp_bytes"]
    assert memory["output_bytes"] > 0 and memory["temp_bytes"] > 0
    assert any(m.startswith("rollout reshard: ") and "of XLA temporaries per device" in m
               for m in caplog.messages)
    monkeypatch.setattr(Sampler, "_free_device_bytes", lambda self: need - 1)
    with pytest.raises(ValueError, match=r"^rollout.layout=replicated: resharding the weights into "
                       r"the rollout layout needs [\d.]+ GiB per device .* free. Choose "
                       r"rollout.layout=tp"):
        sampler()
    monkeypatch.setattr(Sampler, "_free_device_bytes", lambda self: need)
    assert sampler().reshard_stats["reshard_bytes"] > 0


def test_set_weights_reshards_the_new_training_arrays(trained, mesh, prompts, tiny_hf):
    sharded, single = trained["qwen3"]
    s = Sampler(sharded, SamplingParams(greedy=True), buckets=BUCKETS, mesh=mesh, layout="tp")
    first = s.generate(prompts, NEW, list(range(ROWS)))
    _, params = nnx.split(sharded, nnx.Param)
    scaled = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.5, p))(params)   # "an optimizer step"
    stats = s.set_weights(scaled)
    assert stats["reshard_s"] > 0 and stats["reshard_bytes"] == s.reshard_stats["reshard_bytes"]
    new = s.generate(prompts, NEW, list(range(ROWS)))
    ref_model = load_hf(tiny_hf["qwen3"])
    _, ref_params = nnx.split(ref_model, nnx.Param)
    nnx.update(ref_model, jax.tree.map(lambda x: x * 1.5, ref_params))
    ref = Sampler(ref_model, SamplingParams(greedy=True), buckets=BUCKETS).generate(
        prompts, NEW, list(range(ROWS)))
    np.testing.assert_array_equal(new["tokens"], ref["tokens"])
    assert (new["tokens"] != first["tokens"]).any()
    with pytest.raises(ValueError, match="structure differs"):
        s.set_weights(nnx.split(trained["qwen2"][0], nnx.Param)[1])


def test_available_memory_is_the_least_of_meminfo_the_cgroup_left_and_the_host(tmp_path,
                                                                              monkeypatch):
    """It capped MemAvailable by the cgroup's limit only: a container near its limit read as
    having the host's free memory (helper-139). A cgroup v2 limit of "max" is no limit."""
    import jscenegen.sharding.rollout as rollout

    limit, usage, meminfo = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "mi"
    monkeypatch.setattr(rollout, "CGROUP_MEMORY", ((str(limit), str(usage)),))
    monkeypatch.setattr(rollout, "MEMINFO", str(meminfo))
    gib = 2**30
    meminfo.write_text(f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {40 * gib // 1024} kB\n")
    limit.write_text(f"{16 * gib}\n")
    usage.write_text(f"{12 * gib}\n")
    assert rollout.available_memory_bytes() == 4 * gib          # the cgroup's 16 - 12
    usage.write_text(f"{17 * gib}\n")
    assert rollout.available_memory_bytes() == 0                # past its limit
    limit.write_text("max\n")
    assert rollout.available_memory_bytes() == min(40 * gib, rollout.host_memory_bytes())
    meminfo.write_text("garbage\n\n")
    assert rollout.available_memory_bytes() == rollout.host_memory_bytes()


@pytest.mark.parametrize("arch, layout", [("qwen3", "fsdp"), ("qwen3", "tp"), ("qwen3_5", "tp")])
def test_the_cache_fit_counts_the_bytes_each_device_holds(tiny_hf, qwen35_hf, mesh, arch, layout):
    """The guard spread a cache's bytes evenly over the mesh, but under `fsdp` its K/V
    (CACHED_KV = P("fsdp")) are whole on both sp devices: each device held up to twice what
    was checked, so a cache past the memory passed. Now the guard counts the shards the cache
    gets: one byte less memory than a device holds refuses it, exactly that much makes it.
    Qwen3.5 under `tp`: its recurrent states and conv inputs (LAYER_HEADS) split by heads over
    tp as its K/V do (they were whole on both tp devices, 1.2x an even spread); only the
    per-row slot masks and positions repeat on the tp devices."""
    d = tiny_hf[arch] if arch == "qwen3" else qwen35_hf["qwen3_5"]
    s = Sampler(load_hf(d, mesh=mesh), SamplingParams(temperature=1.0), buckets=BUCKETS,
                mesh=mesh, layout=layout, tp=2 if layout == "tp" else None)
    def held(cache):
        on = {}
        for x in jax.tree.leaves(cache):
            for shard in x.addressable_shards:
                on[shard.device] = on.get(shard.device, 0) + shard.data.nbytes
        assert len(on) == 6 and len(set(on.values())) == 1
        return max(on.values())

    cache, _ = s.new_cache(ROWS, 64)
    per_device = held(cache)
    total = sum(x.nbytes for x in jax.tree.leaves(cache))
    if (arch, layout) == ("qwen3", "fsdp"):         # K/V replicated over sp: twice an even spread
        assert per_device > 1.9 * total / 6, (per_device, total)
    if arch == "qwen3_5":                            # states and conv inputs by heads over tp
        assert total / 6 < per_device < 1.01 * total / 6, (per_device, total)
    s._donate = True                                 # one cache alive at a time
    for free, fits in ((per_device - 1, False), (per_device, True)):
        s._cache_makers.clear()
        s._free_device_bytes = lambda free=free: free
        if fits:
            assert s.new_cache(ROWS, 64)[0].valid.shape == (ROWS, 64)
        else:
            with pytest.raises(ValueError, match=f"a KV cache of {ROWS} rows x 64 slots needs "
                               r"[\d.]+ GiB per device, more than the"):
                s.new_cache(ROWS, 64)
    s._free_device_bytes = lambda: None              # unknown memory: no check
    grown = held(s.grow_cache(cache, 128))
    s._free_device_bytes = lambda: grown - 1         # `cache` is in use already: the grown one must fit beside it
    with pytest.raises(ValueError, match=f"a KV cache of {ROWS} rows x 128 slots"):
        s.grow_cache(cache, 128)
    s._free_device_bytes = lambda: grown
    assert held(s.grow_cache(cache, 128)) == grown



def test_qwen35_tp_decode_moves_activations_not_its_kv_cache(qwen35_hf, mesh):
    """Qwen3.5's full-attention K/V cache was whole on each tp device while k_proj/v_proj split
    the kv heads over tp: every step all-gathered each layer's whole cache (36 KB a step here,
    ~32 MiB per row and layer at 8,192 slots of a real model) and read it gathered. With the
    heads of the cache (LAYER_KV) and of the attention's keys (READ_KV) over tp, a step moves
    what Qwen2/3's does: the bound of `test_the_decode_loop_moves_no_weight_bytes`. The Gated
    DeltaNet layers split their heads over tp too: in_proj_qkv/conv1d stored grouped by shard
    (`COLUMN_BLOCKS`), states and conv inputs `LAYER_HEADS`, so a step's only collectives are
    the all-reduces of the row-split products (and the loop's flag)."""
    model = load_hf(qwen35_hf["qwen3_5"], mesh=mesh)
    cfg = model.cfg
    found, moved = _loop_bytes(_sampler(model, "tp", True, mesh), ROWS)
    b = ROWS // 3
    bound = (2 * cfg.num_hidden_layers + 1) * b * cfg.hidden_size * 4 + b * cfg.vocab_size * 4 + 8
    assert 0 < moved <= bound, (moved, bound, sorted(found, key=lambda c: -c.bytes)[:4])
    assert not any(c.op == "all-gather" and c.bytes >= cfg.hidden_size * 16 for c in found), found
    # in_proj_qkv/conv1d grouped by shard (q_r | k_r | v_r): each GDN layer computes its own
    # heads; a plain row split gave shard 0 all of q and moved q/k/v channels every step
    assert all(c.op == "all-reduce" for c in found), [c for c in found if c.op != "all-reduce"]


def test_qwen35_tp3_with_several_gdn_heads_per_shard_samples_as_unsharded(tmp_path_factory, mesh):
    """The grouped [q_r | k_r | v_r] channels beyond the fixture's one key head per shard at
    tp = 2: tp = 3 over 3 key and 6 value heads (2 value heads per key head, 1 and 2 per shard),
    6 query / 3 kv heads. Same tokens and log-probs as the unsharded sampler (prompts longer
    than a bucket: the chunked delta rule in the prefill), only all-reduces in the loop."""
    from qwen35_fixtures import make_qwen35_dir

    sizes = dict(linear_num_key_heads=3, linear_num_value_heads=6, num_attention_heads=6,
                 num_key_value_heads=3, intermediate_size=72)
    d = make_qwen35_dir(tmp_path_factory.mktemp("qwen35_tp3"), "qwen3_5_text", text_sizes=sizes)
    params = SamplingParams(temperature=0.9, top_k=40)
    s = Sampler(load_hf(d, mesh=mesh), params, buckets=BUCKETS, mesh=mesh, layout="tp", tp=3)
    assert s.layout.tp == 3
    groups = {n: v.get_metadata().get("channel_groups") for n, v in
              named_leaves(s.state, is_leaf=lambda x: isinstance(x, nnx.Variable)).items()
              if n.endswith(("in_proj_qkv.weight", "conv1d.weight"))}
    assert groups and set(groups.values()) == {3}
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 389, n).tolist() for n in (11, 20, 5, 14, 3, 9)]
    seeds = list(range(40, 46))
    ref = Sampler(load_hf(d), params, buckets=BUCKETS).generate(prompts, NEW, seeds)
    out = s.generate(prompts, NEW, seeds)
    np.testing.assert_array_equal(out["tokens"], ref["tokens"])
    np.testing.assert_allclose(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    found, _ = _loop_bytes(s, ROWS)
    assert found and all(c.op == "all-reduce" for c in found), [(c.op, c.shapes, c.bytes) for c in found if c.op != "all-reduce"]
