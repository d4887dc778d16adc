"""model.attention's XLA kernel: forward and the gradients of q, k and v against torch
autodiff of transformers' eager attention formula, grouped-query, with padded rows (queries
with no allowed key) and a causal mask; the cache layout gives the same values; bf16 inputs
give bf16 gradients near the fp32 ones. `per_shard` (the cuDNN kernel's shard_map) with the
XLA kernel inside equals the plain kernel on the 3 x 2 mesh, values and gradients, in the
training and rollout layouts; with cuDNN's GPU probes stubbed, the cuDNN path partitions on
that mesh for a train step (Qwen3, Qwen3.5) and for decoding in every rollout layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jscenegen.generate.sampler import Sampler
from jscenegen.generate.sampling import SamplingParams
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.train.step import GRPOStep
from jscenegen.model.attention import per_shard, xla_attention
from jscenegen.model.functional import hidden_fn, split_params
from jscenegen.model.hf_io import load_hf
from jscenegen.model.qwen import full_sequence_inputs
from jscenegen.sharding.constraints import use_specs
from jscenegen.sharding.layout import pad_batch, shard_batch
from jscenegen.sharding.mesh import make_mesh
from jscenegen.sharding.rollout import rollout_mesh
from jscenegen.sharding.rules import ROLLOUT_SPECS, TRAINING_SPECS

B, S, NQ, NKV, D = 3, 12, 4, 2, 8


def _inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, S, NQ, D)).astype(np.float32)
    k = rng.normal(size=(B, S, NKV, D)).astype(np.float32)
    v = rng.normal(size=(B, S, NKV, D)).astype(np.float32)
    cot = rng.normal(size=(B, S, NQ, D)).astype(np.float32)
    valid = np.ones((B, S), bool)
    valid[1, :5] = False        # left padding: queries 0-4 of row 1 see no real key
    valid[2, 9:] = False        # right padding
    _, mask = full_sequence_inputs(jnp.asarray(valid))
    return q, k, v, cot, np.asarray(mask)


def _torch_eager(q, k, v, mask):
    """transformers' eager_attention_forward (repeat_kv, scaled scores, additive float32-min
    mask, fp32 softmax), [B, S, N, D] in and out."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt = kt.repeat_interleave(NQ // NKV, dim=1)
    vt = vt.repeat_interleave(NQ // NKV, dim=1)
    scores = qt @ kt.transpose(2, 3) * D ** -0.5
    scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    return (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_xla_attention_and_its_gradients_match_torch_eager(seed):
    q, k, v, cot, mask = _inputs(seed)

    def f(q, k, v):
        return jnp.sum(xla_attention(q, k, v, jnp.asarray(mask)) * cot)

    out = jax.jit(xla_attention)(q, k, v, jnp.asarray(mask))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tout = _torch_eager(tq, tk, tv, torch.tensor(mask))
    (tout * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(np.asarray(out), tout.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)
    # the padded queries of row 1 average v uniformly: their q gradient is exactly zero
    assert np.all(np.asarray(grads[0])[1, :5] == 0)


def test_masked_keys_get_no_weight_when_the_allowed_scores_are_very_negative():
    """Masked scores sit at float32's minimum (transformers' eager mask), below any real
    score: with q and k scaled so that allowed scores reach -1e5, a masked key still gets
    no weight (a finite stand-in such as -1e4 would outrank them)."""
    q, k, v, _, mask = _inputs(4)
    q, k = q * 200.0, k * 200.0
    out = jax.jit(xla_attention)(q, k, v, jnp.asarray(mask))
    tout = _torch_eager(*(torch.tensor(x) for x in (q, k, v)), torch.tensor(mask))
    scores = np.einsum("bsnd,btnd->bnst", q, np.repeat(k, NQ // NKV, axis=2)) * D ** -0.5
    assert (np.where(mask[:, None], scores, 0) < -2e4).any()   # the regime this test is about
    np.testing.assert_allclose(np.asarray(out), tout.numpy(), rtol=1e-5, atol=1e-5)


def test_cache_layout_gives_the_same_values():
    q, k, v, _, mask = _inputs(2)
    plain = xla_attention(q, k, v, jnp.asarray(mask))
    cached = xla_attention(q, jnp.asarray(k).transpose(0, 2, 3, 1), jnp.asarray(v).swapaxes(1, 2),
                           jnp.asarray(mask), cached=True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(cached))


def test_bf16_inputs_give_bf16_gradients_near_fp32():
    q, k, v, cot, mask = _inputs(3)

    def grads(dtype):
        def f(q, k, v):
            out = xla_attention(q, k, v, jnp.asarray(mask))
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.grad(f, argnums=(0, 1, 2))(*(jnp.asarray(x, dtype) for x in (q, k, v)))

    for low, full in zip(grads(jnp.bfloat16), grads(jnp.float32)):
        assert low.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(full)))
        assert float(jnp.max(jnp.abs(low.astype(jnp.float32) - full))) < 0.05 * scale


# ---- per_shard: the shard_map the cuDNN kernel runs in ------------------------------------
def _recording(kernel, seen):
    """`kernel`, noting the (q, k, mask) shapes each call gets (per shard inside shard_map)."""
    def run(q, k, v, mask, cached):
        seen.append((q.shape, k.shape, mask.shape))
        return kernel(q, k, v, mask, cached)
    return run


@pytest.mark.parametrize("layout", ["training", "rollout"])
def test_per_shard_xla_equals_the_plain_kernel_on_the_mesh(layout):
    """Training (3 x 2): each device gets 2 of the 6 rows and 6 of the 12 query positions
    with their mask rows, every key; rollout (data 3 x tp 2): 2 rows and one of the two kv
    heads with its two query heads. Values and the q/k/v gradients equal the unsharded
    kernel's (k/v gradients summed over the shards that read them)."""
    q, k, v, cot, mask = _inputs(4)
    q, k, v, cot = (np.concatenate([x, x[::-1] * 0.5]) for x in (q, k, v, cot))   # B = 6
    mask = np.concatenate([mask, mask[::-1]])
    mesh = make_mesh(3, 2)
    specs = TRAINING_SPECS
    if layout == "rollout":
        mesh, specs = rollout_mesh(mesh, 2), ROLLOUT_SPECS
    seen = []

    def loss(kernel):
        def f(q, k, v):
            return jnp.sum(kernel(q, k, v, jnp.asarray(mask)) * cot)
        return f

    def sharded(q, k, v, mask):
        return per_shard(_recording(xla_attention, seen), q, k, v, mask)

    want = xla_attention(q, k, v, jnp.asarray(mask))
    want_grads = jax.grad(loss(xla_attention), argnums=(0, 1, 2))(q, k, v)
    with jax.set_mesh(mesh), use_specs(specs):
        got = jax.jit(sharded)(q, k, v, jnp.asarray(mask))
        grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    per_device = {"training": ((2, S // 2, NQ, D), (2, S, NKV, D), (2, S // 2, S)),
                  "rollout": ((2, S, NQ // 2, D), (2, S, NKV // 2, D), (2, S, S))}[layout]
    assert set(seen) == {per_device}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_per_shard_keeps_a_one_token_query_whole_over_sp():
    """Cached decode under the fsdp rollout layout (the training specs): S = 1 cannot be split
    over sp = 2, so each device takes its 2 rows' single query and their whole cache
    (head-major, keys transposed); values equal the unsharded kernel's."""
    rng = np.random.default_rng(5)
    smax = 10
    q = rng.normal(size=(6, 1, NQ, D)).astype(np.float32)
    k = rng.normal(size=(6, NKV, D, smax)).astype(np.float32)
    v = rng.normal(size=(6, NKV, smax, D)).astype(np.float32)
    mask = np.ones((6, 1, smax), bool)
    mask[:, :, 7:] = False
    mask[2, :, :3] = False
    seen = []
    want = xla_attention(q, k, v, jnp.asarray(mask), cached=True)
    with jax.set_mesh(make_mesh(3, 2)):
        got = jax.jit(lambda *a: per_shard(_recording(xla_attention, seen), *a, cached=True))(
            q, k, v, jnp.asarray(mask))
    assert set(seen) == {((2, 1, NQ, D), (2, NKV, D, smax), (2, 1, smax))}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# ---- cuDNN on the mesh, on CPU --------------------------------------------------------------
@pytest.fixture
def cudnn_stubbed(monkeypatch):
    """cuDNN's version and capability probes answered as on an H100 (jax 0.10.2's private
    `fused_attention_stablehlo`; jax is pinned), so `jax.nn.dot_product_attention(
    implementation="cudnn")` traces on CPU and its sharding rules run; only the kernel's
    lowering then fails, with "MLIR translation rule for primitive
    'dot_product_attention_fwd' not found for platform cpu": everything before it, the
    partitioning included, passed. Yields the (q, k, mask) shapes each kernel call got."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda c: True)
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: False)
    seen = []
    kernel = jax.nn.dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.shape, k.shape, kwargs["mask"].shape))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return seen


LOWERING_ONLY = "MLIR translation rule for primitive 'dot_product_attention_fwd' not found for platform cpu"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cudnn_attention_partitions_for_a_train_step_on_the_3x2_mesh(request, cudnn_stubbed, arch):
    """Rows over fsdp = 3, positions over sp = 2 (configs/grpo100.yaml's mesh): cuDNN's own
    partitioner refused this ("Query, key and value should have same sharding"); per shard,
    each kernel call gets 2 rows, 32 of the 64 query positions with their mask rows and all
    64 keys. Qwen3.5's full-attention layers (one in the fixture) run the same code."""
    path = (request.getfixturevalue("tiny_hf")["qwen3"] if arch == "qwen3"
            else request.getfixturevalue("qwen35_hf")["qwen3_5_text"])
    mesh = make_mesh(3, 2)
    model = load_hf(path, mesh=mesh, compute_dtype="bfloat16", attn_impl="cudnn")
    graphdef, params, frozen = split_params(model)
    step = GRPOStep(hidden_fn(graphdef, frozen), LossConfig(ppo_micro_batch_size=6), OptimConfig(),
                    donate=False)
    b = shard_batch(pad_batch({"ids": np.ones((6, 64), np.int32),
                               "mask": np.ones((6, 64), np.int32)}, mesh), mesh)
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError) as err:
        step.logprobs(params, b["ids"], b["mask"])
    assert str(err.value) == LOWERING_ONLY
    cfg = model.cfg
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert set(cudnn_stubbed) == {((2, 32, heads, d), (2, 64, kv, d), (2, 1, 32, 64))}


@pytest.mark.parametrize("layout", ["fsdp", "replicated", "tp"])
def test_cudnn_attention_partitions_for_decoding_on_the_3x2_mesh(tiny_hf, cudnn_stubbed, layout):
    """The sampler's decode in each rollout layout. fsdp (the training specs): cuDNN's
    partitioner refused the sp-split queries over the fsdp-split cache; per shard each call
    gets 2 of the 6 rows, the whole query and cache. tp = 2: the heads split too."""
    mesh = make_mesh(3, 2)
    model = load_hf(tiny_hf["qwen3"], mesh=mesh, compute_dtype="bfloat16", attn_impl="cudnn")
    sampler = Sampler(model, SamplingParams(greedy=True), buckets=(16, 32), mesh=mesh,
                      layout=layout, tp=2 if layout == "tp" else None)
    with pytest.raises(NotImplementedError) as err:
        sampler.decode_hlo(6, 32, 8)
    assert str(err.value) == LOWERING_ONLY
    cfg = model.cfg
    split = 2 if layout == "tp" else 1
    rows = 6 // sampler.layout.row_multiple    # fsdp and tp: 3-way rows; replicated: 6-way
    assert cudnn_stubbed[0] == ((rows, 1, cfg.num_attention_heads // split, cfg.head_dim),
                                (rows, 32, cfg.num_key_value_heads // split, cfg.head_dim),
                                (rows, 1, 1, 32))
