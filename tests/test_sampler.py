"""The KV-cache sampler: greedy vs the full forward, log-probs vs the trainer's recompute (also on
the 3 x 2 mesh), temperature, top-k/top-p, stop ids/strings, per-row budgets, determinism, buckets."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jscenegen.generate.sampler import (
    STOP_LENGTH,
    STOP_NONE,
    STOP_STRING,
    STOP_TOKEN,
    Sampler,
    check_buckets,
    split_into_buckets,
)
from jscenegen.generate.sampling import (
    MIN_TEMPERATURE,
    SamplingParams,
    _nucleus,
    block_max_top_k,
    chunked_top_k,
    row_keys,
    top_k,
    top_p_threshold,
)
from jscenegen.generate.stop import build_stop_table, stop_string_step
from jscenegen.grpo.algo.config import LossConfig, OptimConfig
from jscenegen.grpo.rollout.config import SamplingConfig
from jscenegen.grpo.train.step import GRPOStep
from jscenegen.model.functional import hidden_fn
from jscenegen.model.hf_io import load_hf
from jscenegen.model.weights import named_leaves

BUCKETS = (16, 32, 64)
PROMPT_LENS = (11, 5)


@pytest.fixture(scope="session")
def model(tiny_hf):
    return load_hf(tiny_hf["qwen3"])


@pytest.fixture(scope="session")
def prompts(model):
    rng = np.random.default_rng(7)
    return [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in PROMPT_LENS]


@functools.cache
def _full_forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda st, ids, mask: nnx.merge(graphdef, st)(ids, mask)), state


def full_logits(model, seqs, length=32):
    """Logits [B, L, V] of sequences right-padded to `length`, through the full (uncached) forward."""
    ids = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    fn, state = _full_forward(model)
    return np.asarray(fn(state, jnp.asarray(ids), jnp.asarray(mask)))


@functools.cache
def _trainer(model, temperature):
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    return GRPOStep(hidden_fn(graphdef, *rest), LossConfig(), OptimConfig(),
                    temperature=temperature, donate=False), params


def trainer_logprobs(model, seqs, temperature):
    """The train step's old_logp recompute (GRPOStep.logprobs) on sequences right-padded to a
    multiple of 256 (few compiled shapes)."""
    step, params = _trainer(model, temperature)
    n = -(-max(len(s) for s in seqs) // 256) * 256
    ids = np.zeros((len(seqs), n), np.int32)
    mask = np.zeros((len(seqs), n), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return np.asarray(step.logprobs(params, jnp.asarray(ids), jnp.asarray(mask))[0])


def test_greedy_equals_stepwise_argmax_of_full_forward(model, prompts):
    s = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS)
    out = s.generate(prompts, 6, seeds=[0, 1])
    assert out["lengths"].tolist() == [6, 6] and (out["reason"] == STOP_LENGTH).all()
    seqs = [list(p) for p in prompts]
    for _ in range(6):
        logits = full_logits(model, seqs)
        for i, sq in enumerate(seqs):
            sq.append(int(np.argmax(logits[i, len(sq) - 1])))
    for i, p in enumerate(prompts):
        assert out["tokens"][i].tolist() == seqs[i][len(p):]


def test_samplers_of_one_structure_share_compiled_functions_not_weights(model, prompts, tiny_hf):
    """Every Trainer's sampler re-traced and re-lowered its prefill/decode (~1.5 s for the
    tiny model per instance): equally structured models with the same options share them
    now (other options do not), and each sampler still decodes with its own weights."""
    greedy = SamplingParams(greedy=True)
    first = Sampler(model, greedy, buckets=BUCKETS)
    other = load_hf(tiny_hf["qwen3"])
    nnx.update(other, jax.tree.map(lambda x: x + 0.05 * jnp.cos(jnp.arange(x.size).reshape(x.shape)),
                                   nnx.state(other, nnx.Param)))
    second = Sampler(other, greedy, buckets=BUCKETS)
    assert second._decode is first._decode and second._append is first._append
    assert Sampler(model, SamplingParams(temperature=0.7), buckets=BUCKETS)._decode is not first._decode
    want = first.generate(prompts, 6, seeds=[0, 1])["tokens"]
    assert not np.array_equal(second.generate(prompts, 6, seeds=[0, 1])["tokens"], want)
    second.set_weights(model)
    np.testing.assert_array_equal(second.generate(prompts, 6, seeds=[0, 1])["tokens"], want)


def test_refused_weights_leave_the_sampler_its_own(model, prompts, tiny_hf):
    """`set_weights` dropped the rollout weights before the reshard checked the new ones'
    structure: after the ValueError the sampler had no weights and its next generate failed.
    It checks first now and still decodes the tokens it decoded before."""
    s = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS)
    want = s.generate(prompts, 6, seeds=[0, 1])["tokens"]
    other = nnx.split(load_hf(tiny_hf["qwen2"]), nnx.Param, ...)[1]
    with pytest.raises(ValueError, match="reshard: the parameters' structure differs"):
        s.set_weights(other)
    np.testing.assert_array_equal(s.generate(prompts, 6, seeds=[0, 1])["tokens"], want)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.0, top_k=20, top_p=0.9)])
def test_sampled_logprobs_equal_trainer_recompute(model, prompts, params):
    s = Sampler(model, params, buckets=BUCKETS)
    out = s.generate(prompts, 8, seeds=[3, 4])
    seqs = [p + out["tokens"][i].tolist() for i, p in enumerate(prompts)]
    want = trainer_logprobs(model, seqs, params.temperature)
    for i, p in enumerate(prompts):
        got = out["logprobs"][i]
        np.testing.assert_allclose(got, want[i, len(p):len(p) + 8], atol=1e-5, rtol=0)
        assert got.dtype == np.float32 and np.all(got < 0)


def test_rows_must_split_over_the_layouts_data_parallel_size(tiny_hf):
    # the layouts themselves (same tokens as here, on the 3 x 2 mesh) are tests/test_rollout_layout.py
    from jscenegen.sharding.mesh import make_mesh

    mesh = make_mesh(3, 2)
    sharded = load_hf(tiny_hf["qwen3"], mesh=mesh)
    for layout, rows in (("replicated", 6), ("fsdp", 3)):
        s = Sampler(sharded, SamplingParams(temperature=0.8), buckets=BUCKETS, mesh=mesh, layout=layout)
        assert s.row_multiple == rows
        with pytest.raises(ValueError, match=f"2 rows do not split over the rollout layout's {rows} "):
            s.new_cache(2, 32)


def test_logprobs_are_of_the_tempered_distribution(model, prompts):
    res = {}
    for t in (0.6, 1.0):
        out = Sampler(model, SamplingParams(temperature=t), buckets=BUCKETS).generate(prompts, 5, [9, 9])
        seqs = [p + out["tokens"][i].tolist() for i, p in enumerate(prompts)]
        logits = full_logits(model, seqs)
        for i, p in enumerate(prompts):
            for k in range(5):
                z = logits[i, len(p) + k - 1].astype(np.float64)
                tok = out["tokens"][i, k]
                tempered = z / t - np.log(np.sum(np.exp(z / t - (z / t).max()))) - (z / t).max()
                assert out["logprobs"][i, k] == pytest.approx(tempered[tok], abs=2e-5)
                if t != 1.0:
                    raw = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
                    assert abs(out["logprobs"][i, k] - raw[tok]) > 1e-3
        res[t] = out
    # a colder distribution puts more mass on what it samples
    assert res[0.6]["logprobs"].mean() > res[1.0]["logprobs"].mean()


def test_top_k_and_top_p_restrict_the_draw(model, prompts):
    for params, check in [
        (SamplingParams(temperature=1.5, top_k=3), "k"),
        (SamplingParams(temperature=1.5, top_p=0.3), "p"),
    ]:
        out = Sampler(model, params, buckets=BUCKETS).generate(prompts, 12, [11, 12])
        seqs = [p + out["tokens"][i].tolist() for i, p in enumerate(prompts)]
        logits = full_logits(model, seqs)
        for i, p in enumerate(prompts):
            for k in range(12):
                z = logits[i, len(p) + k - 1] / 1.5
                tok = out["tokens"][i, k]
                rank = int(np.sum(z > z[tok]))
                if check == "k":
                    assert rank < 3
                else:
                    prob = np.exp(z - z.max())
                    prob /= prob.sum()
                    assert prob[z > z[tok]].sum() < 0.3 + 1e-6



@pytest.mark.parametrize("scale", [4.0, 2.0])
def test_top_p_keeps_the_exact_nucleus_at_the_vocabulary_size(scale):
    """Qwen's 151,936 logits, top_p 0.999: the nucleus ends among tail tokens of ~1e-9. The
    threshold was bisected on the values (resolution max prob x 2^-32) against a float32 sum
    of the kept mass near 1: over three draws 64 tokens too many and 1 too few (scale 4), 10
    too many and 6 too few (scale 2) against the nucleus of the float64 probabilities. Bisected on the bit patterns against
    the tail's mass (transformers' formulation) it keeps exactly that nucleus, and the
    threshold is the probability of the least likely kept token."""
    rng = np.random.default_rng(0)
    nucleus = jax.jit(_nucleus, static_argnums=1)

    @jax.jit
    def threshold(z):
        probs = jax.nn.softmax(z, axis=-1)
        return probs, top_p_threshold(probs, 0.999)

    if scale == 2.0:
        rng.standard_normal((3, 8, 151936))                  # the draws of the scale-4 case
    for _ in range(3):
        z = (rng.standard_normal((8, 151936)) * scale).astype(np.float32)
        kept = np.isfinite(np.asarray(nucleus(jnp.asarray(z), 0.999)))
        z64 = z.astype(np.float64)
        prob = np.exp(z64 - z64.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        exact = np.zeros_like(kept)
        for b in range(8):
            order = np.argsort(-prob[b], kind="stable")
            above = np.concatenate([[0.0], np.cumsum(prob[b, order])[:-1]])
            exact[b, order[above < 0.999]] = True
        np.testing.assert_array_equal(kept, exact)
        assert 1000 < kept.sum(1).min() < 151936
        probs32, t = map(np.asarray, threshold(jnp.asarray(z)))
        np.testing.assert_array_equal(t[:, 0], np.where(probs32 >= t, probs32, np.inf).min(1))
        np.testing.assert_array_equal(probs32 >= t, exact)

def test_stop_token_and_per_row_budgets(model, prompts):
    greedy = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS)
    ref = greedy.generate(prompts, 6, [0, 0])["tokens"]
    stop_id = int(ref[0, 2])
    first = [int(np.argmax(ref[i] == stop_id)) if stop_id in ref[i] else None for i in range(2)]
    s = Sampler(model, SamplingParams(greedy=True), stop_token_ids=[stop_id], buckets=BUCKETS)
    cache, last = s.new_cache(2, 64)
    cache, last = s.append(cache, last, prompts)
    out = s.decode(cache, last, [6, 4], np.zeros((2, 2), np.uint32), max_steps=6)
    lengths, reason = np.asarray(out.lengths), np.asarray(out.reason)
    assert lengths[0] == first[0] + 1 and reason[0] == STOP_TOKEN
    assert np.asarray(out.tokens)[0, lengths[0] - 1] == stop_id
    assert np.all(np.asarray(out.tokens)[0, lengths[0]:] == 0)
    if first[1] is not None and first[1] < 4:
        assert lengths[1] == first[1] + 1 and reason[1] == STOP_TOKEN
    else:
        assert lengths[1] == 4 and reason[1] == STOP_LENGTH


def test_stop_string_across_tokens_in_the_decode_loop(model, prompts):
    ref = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS).generate(prompts, 6, [0, 0])["tokens"]
    vocab = [f"<{i}>".encode() for i in range(model.cfg.vocab_size)]
    t2, t3 = int(ref[0, 2]), int(ref[0, 3])
    stop = f"{t2}><{t3}"                      # spans the end of token 2 and the start of token 3
    text0 = b"".join(vocab[t] for t in ref[0]).decode()
    end = text0.index(stop) + len(stop)
    expect = next(k + 1 for k in range(6) if len(b"".join(vocab[t] for t in ref[0, :k + 1])) >= end)
    s = Sampler(model, SamplingParams(greedy=True), stop_strings=[stop], token_bytes=vocab,
                buckets=BUCKETS)
    out = s.generate(prompts, 6, [0, 0])
    assert out["lengths"][0] == expect <= 4 and out["reason"][0] == STOP_STRING
    text1 = b"".join(vocab[t] for t in ref[1]).decode()
    if stop not in text1:
        assert out["lengths"][1] == 6 and out["reason"][1] == STOP_LENGTH


def test_stop_string_byte_matching_however_the_tokens_split():
    vocab = [b"</", b"action", b">", b"</action>", b">\n\n", b"ok", b"x</action>y", b"</act", b"ion>",
             b"", "é".encode()]
    table = build_stop_table([b"</action>"], vocab, len(vocab))
    k1 = 8

    step = jax.jit(lambda tail, t: stop_string_step(table, [b"</action>"], tail, t))

    def run(seq):
        tail = jnp.full((1, k1), -1, jnp.int32)
        hits = []
        for t in seq:
            hit, tail = step(tail, jnp.asarray([t]))
            hits.append(bool(hit[0]))
        return hits

    assert run([5, 0, 1, 2]) == [False, False, False, True]
    assert run([5, 3]) == [False, True]
    assert run([0, 1, 4]) == [False, False, True]
    assert run([6]) == [True]
    assert run([7, 9, 8]) == [False, False, True]      # an empty token in between
    assert run([0, 5, 1, 2]) == [False, False, False, False]
    assert run([10, 0, 10, 1, 2]) == [False] * 5


def test_same_seed_same_tokens_and_rows_are_independent(model, prompts):
    s = Sampler(model, SamplingParams(temperature=1.0), buckets=BUCKETS)
    a = s.generate(prompts, 8, [21, 22])
    b = s.generate(prompts, 8, [21, 22])
    c = s.generate(prompts, 8, [23, 24])
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    assert (a["tokens"] != c["tokens"]).any()
    # row 0 draws the same tokens whatever the other row is
    d = s.generate([prompts[0], prompts[0][:4]], 8, [21, 99])
    np.testing.assert_array_equal(a["tokens"][0], d["tokens"][0])


def test_row_keys_are_the_per_seed_keys_of_jax():
    seeds = [0, 7, 2**31 - 1, 2**31, 2**32 - 1, -1, 2**40 + 5]
    want = [np.asarray(jax.random.key_data(jax.random.key(s & 0xFFFFFFFF))) for s in seeds]
    got = row_keys(seeds)
    assert got.dtype == np.uint32 and got.shape == (len(seeds), 2)
    np.testing.assert_array_equal(got, np.stack(want))
    np.testing.assert_array_equal(got[2], [0, 2**31 - 1])


@pytest.mark.parametrize("vocab,k,chunk", [(1000, 7, 64), (4096, 50, 1024), (3001, 64, 64)])
def test_chunked_top_k_is_lax_top_k_ties_and_padding_included(vocab, k, chunk):
    rng = np.random.default_rng(vocab)
    z = rng.normal(size=(5, vocab)).astype(np.float32)
    z[0, 10:200] = z[0, 3]                        # ties across chunk boundaries
    z[1] = np.round(z[1])                         # a handful of values, many ties each
    z[2, k // 2:] = -np.inf                       # fewer finite values than k
    z[3, -chunk // 2:] = 9.0                      # the maxima in the padded last chunk
    want = jax.lax.top_k(jnp.asarray(z), k)
    got = jax.jit(functools.partial(chunked_top_k, k=k, chunk=chunk))(jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _marked_fallback(z, k):
    """A fallback whose result no top-k can return: shows which branch block_max_top_k took."""
    return jnp.full((z.shape[0], k), jnp.nan, z.dtype), jnp.full((z.shape[0], k), -1, jnp.int32)


@pytest.mark.parametrize("vocab,k,block", [(5000, 50, 64), (3001, 7, 32), (4096, 20, 16)])
def test_block_max_top_k_is_lax_top_k_without_its_fallback(vocab, k, block):
    rng = np.random.default_rng(vocab)
    z = rng.normal(size=(6, vocab)).astype(np.float32)
    z[0, 10:200] = z[0, 3] + 5                    # ties, many blocks' maxima equal, in the top k
    z[1] = np.round(z[1] * 8) / 8                 # many ties everywhere
    z[2, 700:700 + 4 * k] = 7.0                   # the whole top k in a few adjacent blocks
    z[3, -(vocab % block or block):] = 9.0        # the maxima in the (padded) last block
    z[4, : 3 * block] = -np.inf                   # -inf blocks
    z[5, [17, vocab // 2]] = np.nan               # lax.top_k ranks NaN above every number
    fn = jax.jit(functools.partial(block_max_top_k, k=k, block=block, fallback=_marked_fallback))
    got = fn(jnp.asarray(z))
    want = jax.lax.top_k(jnp.asarray(z), k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_block_max_top_k_falls_back_on_a_tie_at_the_threshold():
    z = np.random.default_rng(1).normal(size=(3, 4096)).astype(np.float32)
    z[1] = 0.0                                    # every block's maximum ties: no block is ruled out
    fast = jax.jit(functools.partial(block_max_top_k, k=20, block=16, fallback=_marked_fallback))
    assert np.isnan(np.asarray(fast(jnp.asarray(z))[0])).all()   # the whole batch fell back
    got = jax.jit(functools.partial(block_max_top_k, k=20, block=16))(jnp.asarray(z))
    want = jax.lax.top_k(jnp.asarray(z), 20)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    with pytest.raises(ValueError, match="blocks"):
        block_max_top_k(jnp.asarray(z), k=250, block=16)


def test_top_k_takes_the_block_max_path_on_gpu_only():
    z = jax.ShapeDtypeStruct((8, 151936), jnp.float32)
    fn = jax.jit(lambda z: top_k(z, 50))
    ops = {p: fn.trace(z).lower(lowering_platforms=(p,)).as_text().count("top_k") for p in ("cpu", "cuda")}
    # cuda: the block maxima's and the candidates' top-k, then chunked_top_k's two (the fallback)
    assert ops == {"cpu": 1, "cuda": 4}, ops
    small = jax.jit(lambda z: top_k(z, 50)).trace(jax.ShapeDtypeStruct((8, 4096), jnp.float32))
    assert small.lower(lowering_platforms=("cuda",)).as_text().count("top_k") == 1


def test_bucketed_appends_do_not_recompile(model):
    assert split_into_buckets(5, BUCKETS) == [16]
    assert split_into_buckets(70, BUCKETS) == [64, 16]
    s = Sampler(model, SamplingParams(), buckets=BUCKETS)
    cache, last = s.new_cache(2, 64)
    traces = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: traces.append(event) if event.endswith("jaxpr_trace_duration") else None)
    for n in (3, 9, 16):
        cache, last = s.append(cache, last, [[5] * n, [6] * (n + 1) if n < 16 else []])
        if n == 3:
            first = len(traces)
    assert first >= 1 and len(traces) == first  # later appends of other lengths trace nothing
    assert int(cache.length) == 16 * 3
    assert np.asarray(cache.next_pos).tolist() == [28, 14]


def test_a_grown_cache_decodes_as_a_big_one(model, prompts):
    s = Sampler(model, SamplingParams(temperature=1.0), buckets=BUCKETS)
    keys = row_keys([3, 4])
    big, last = s.new_cache(2, 64)
    big, last_b = s.append(big, last, prompts)
    small, last = s.new_cache(2, 16)
    small, last_s = s.append(small, last, prompts)
    assert int(small.length) == 16
    grown = s.grow_cache(small, 64)
    assert grown.k[0].shape[-1] == grown.v[0].shape[-2] == grown.valid.shape[1] == 64
    np.testing.assert_array_equal(np.asarray(grown.valid[:, :16]), np.asarray(small.valid))
    a = s.decode(big, last_b, [6, 6], keys, 6)
    b = s.decode(grown, last_s, [6, 6], keys, 6)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-6)
    with pytest.raises(ValueError, match="8 slots < the cache's 16"):
        s.grow_cache(small, 8)


def test_a_cache_beyond_the_devices_memory_is_refused_before_it_is_made(model):
    """Asked for 2^33 slots a row, the cache was allocated until the process was killed."""
    s = Sampler(model, SamplingParams(temperature=1.0), buckets=BUCKETS)
    with pytest.raises(ValueError, match=r"a KV cache of 2 rows x 8,589,934,592 slots needs "
                       r"[\d,.]+ GiB per device, more than the [\d,.]+ GiB one has free: lower the "
                       r"episode and turn caps \(sampling.max_episode_tokens"):
        s.new_cache(2, 2**33)
    small, _ = s.new_cache(2, 16)
    with pytest.raises(ValueError, match=r"a KV cache of 2 rows x 8,589,934,592 slots"):
        s.grow_cache(small, 2**33)


def test_a_grow_counts_the_cache_it_copies_from(model):
    """With buffer donation (GPU, TPU) a cache costs its own bytes, but a grow holds the old
    cache and the grown one together: only the grown one was checked."""
    s = Sampler(model, SamplingParams(temperature=1.0), buckets=BUCKETS)
    s._donate = True
    small, _ = s.new_cache(2, 64)
    grown_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: s.create_cache(s.cfg, 2, 256, s.cache_dtype))))
    small_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(small))
    assert small_bytes > 0
    s._free_device_bytes = lambda: grown_bytes - 1      # beside `small` (in use), not the grown one
    with pytest.raises(ValueError, match=r"a KV cache of 2 rows x 256 slots needs"):
        s.grow_cache(small, 256)
    s._free_device_bytes = lambda: grown_bytes
    assert s.grow_cache(small, 256).valid.shape == (2, 256)


def test_the_cache_fit_leaves_out_the_memory_arrays_already_hold(model, monkeypatch):
    """The guard compared a cache with the device's whole memory: with the weights, the
    optimizer state and the previous caches holding most of it, a cache that passed was
    allocated until the process died. Now the limit is what the device has free (a GPU's
    `bytes_limit - bytes_in_use`; the host's available memory on CPU); without donation (CPU)
    a decode call holds its input and output caches, so twice the cache must fit."""
    import jscenegen.generate.sampler as sampler_module
    import jscenegen.sharding.rollout as rollout

    s = Sampler(model, SamplingParams(temperature=1.0), buckets=BUCKETS)
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: s.create_cache(s.cfg, 2, 512, s.cache_dtype))))
    monkeypatch.setattr(rollout, "available_memory_bytes",
                        lambda: jax.local_device_count() * (2 * need - 1))
    monkeypatch.setattr(sampler_module, "least_free_device_memory_bytes",
                        rollout.least_free_device_memory_bytes)
    assert not s._donate
    with pytest.raises(ValueError, match=r"a KV cache of 2 rows x 512 slots needs [\d.]+ GiB per "
                                         r"device, more than the [\d.]+ GiB one has free"):
        s.new_cache(2, 512)
    monkeypatch.setattr(rollout, "available_memory_bytes",
                        lambda: jax.local_device_count() * 2 * need)
    assert s.new_cache(2, 512)[0].valid.shape == (2, 512)


def test_a_devices_free_memory_is_its_limit_less_its_bytes_in_use(monkeypatch):
    """GPU/TPU: the allocator's limit less the bytes live arrays hold; CPU without memory
    stats: the host's available memory shared by the local devices; unknown: None."""
    import jscenegen.sharding.rollout as rollout

    class Device:
        def __init__(self, platform, stats):
            self.platform, self.stats = platform, stats

        def memory_stats(self):
            return self.stats

    gpu = Device("gpu", {"bytes_limit": 80 * 2**30, "bytes_in_use": 30 * 2**30})
    assert rollout.free_device_memory_bytes(gpu) == 50 * 2**30
    assert rollout.device_memory_bytes(gpu) == 80 * 2**30
    monkeypatch.setattr(rollout, "available_memory_bytes", lambda: 12 * 2**30)
    monkeypatch.setattr(rollout.jax, "local_device_count", lambda: 6)
    assert rollout.free_device_memory_bytes(Device("cpu", None)) == 2 * 2**30
    assert rollout.free_device_memory_bytes(Device("tpu", None)) is None


# ---- Qwen3.5: the same sampler over the hybrid cache (K/V + Gated DeltaNet states) -----------
@pytest.fixture(scope="module")
def qwen35(qwen35_hf):
    return load_hf(qwen35_hf["qwen3_5"])


@pytest.fixture(scope="module")
def qwen35_prompts(qwen35):
    rng = np.random.default_rng(8)
    return [rng.integers(3, qwen35.cfg.vocab_size, n).tolist() for n in (*PROMPT_LENS, 3)]


@pytest.fixture(scope="module")
def qwen35_sampler(qwen35):
    """One sampler (one set of compiled programs: 3 rows, 64 slots, 6 decode steps)."""
    return Sampler(qwen35, SamplingParams(temperature=0.8), buckets=BUCKETS)


def test_a_grown_qwen35_cache_decodes_as_a_big_one(qwen35, qwen35_prompts):
    """The hybrid cache had no `grown`: the rollout sized it for the whole episode cap at once
    (attention over every slot; 2^20 slots took the process past the host's memory)."""
    s = Sampler(qwen35, SamplingParams(temperature=1.0), buckets=BUCKETS)
    assert s.can_grow
    rows, keys = len(qwen35_prompts), row_keys(range(len(qwen35_prompts)))
    big, last_b = s.append(*s.new_cache(rows, 64), qwen35_prompts)
    small, last_s = s.append(*s.new_cache(rows, 16), qwen35_prompts)
    grown = s.grow_cache(small, 64)
    assert grown.k.shape[2] == grown.v.shape[2] == grown.valid.shape[1] == 64
    np.testing.assert_array_equal(np.asarray(grown.state), np.asarray(small.state))
    a = s.decode(big, last_b, [6] * rows, keys, 6)
    b = s.decode(grown, last_s, [6] * rows, keys, 6)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-6)


def test_qwen35_cached_generation_equals_the_full_forward_at_every_step(qwen35, qwen35_prompts,
                                                                        qwen35_sampler):
    """Prefill (left-padded bucket), decode with per-row budgets (finished rows append
    masked slots), then a cache rebuild (fresh cache, whole history re-appended, as the
    rollout engine does when the cache is full) and more decoding: every sampled token's
    log-prob is the tempered log-softmax of the full forward's logits at that position, and
    the rebuilt cache continues exactly as the original one."""
    s, prompts = qwen35_sampler, qwen35_prompts
    keys = np.asarray([[1, 2], [3, 4], [5, 6]], np.uint32)
    cache, last = s.new_cache(3, 64)
    cache, last = s.append(cache, last, prompts)
    first = s.decode(cache, last, [6, 3, 5], keys, max_steps=6)
    lengths = np.asarray(first.lengths).tolist()
    assert lengths == [6, 3, 5]
    seqs = [p + np.asarray(first.tokens)[i, :n].tolist() for i, (p, n) in enumerate(zip(prompts, lengths))]
    # continue in the same cache, and in a rebuilt one
    more = s.decode(first.cache, first.last_logits, [4, 4, 2], keys + 7, max_steps=6)
    cache2, last2 = s.new_cache(3, 64)
    cache2, last2 = s.append(cache2, last2, seqs)
    rebuilt = s.decode(cache2, last2, [4, 4, 2], keys + 7, max_steps=6)
    np.testing.assert_array_equal(np.asarray(rebuilt.tokens), np.asarray(more.tokens))
    np.testing.assert_allclose(np.asarray(rebuilt.logprobs), np.asarray(more.logprobs), atol=2e-5)
    extra = np.asarray(more.lengths).tolist()
    logits = full_logits(qwen35, [sq + np.asarray(more.tokens)[i, :extra[i]].tolist()
                                  for i, sq in enumerate(seqs)])
    for i, p in enumerate(prompts):
        toks = np.asarray(first.tokens)[i, :lengths[i]].tolist() + np.asarray(more.tokens)[i, :extra[i]].tolist()
        lps = np.asarray(first.logprobs)[i, :lengths[i]].tolist() + np.asarray(more.logprobs)[i, :extra[i]].tolist()
        for k, (tok, lp) in enumerate(zip(toks, lps)):
            z = logits[i, len(p) + k - 1].astype(np.float64) / 0.8
            z -= z.max()
            assert lp == pytest.approx(z[tok] - np.log(np.exp(z).sum()), abs=2e-5)
        np.testing.assert_allclose(np.asarray(more.last_logits)[i], logits[i, len(p) + len(toks) - 1],
                                   atol=2e-5)


def test_a_trainable_vision_tower_is_not_in_the_rollout_copy(qwen35_hf, qwen35_prompts,
                                                            qwen35_sampler):
    """With model.train_vision the tower's tensors are `nnx.Param`s, and the sampler copied
    them whole (fp32) to every device and counted them in `auto`'s weight bytes, though text
    decoding never reads them. Now the copy holds what decoding reads (`decode_params`), the
    samples are those of a carried tower, and `set_weights` takes the trainer's whole state."""
    model = load_hf(qwen35_hf["qwen3_5"], train_vision=True)
    s = Sampler(model, SamplingParams(temperature=0.8), buckets=BUCKETS)
    names = set(named_leaves(s.state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    trained = set(named_leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    tower = {n for n in trained if n.startswith("model.visual.")}
    assert tower and names == trained - tower
    want = qwen35_sampler.generate(qwen35_prompts, 6, seeds=[5, 6, 7], cache_len=64)
    s.set_weights(nnx.state(model, nnx.Param))      # what the trainer hands over: tower included
    got = s.generate(qwen35_prompts, 6, seeds=[5, 6, 7], cache_len=64)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-6, rtol=0)
    s.set_weights(model)
    assert set(named_leaves(s.state, is_leaf=lambda x: isinstance(x, nnx.Variable))) == names


@pytest.mark.parametrize("layout", ["fsdp", "replicated", "tp"])
def test_qwen35_sampling_on_the_3x2_mesh_equals_unsharded(qwen35_hf, qwen35_prompts, qwen35_sampler,
                                                         layout):
    """The hybrid cache in the rollout layouts (its [L, B, ...] arrays rows over the layout's
    data-parallel devices; the weights resharded: Gated DeltaNet and attention alike)."""
    from jscenegen.sharding.mesh import make_mesh
    from jscenegen.sharding.rules import LAYER_HEADS

    mesh = make_mesh(3, 2)
    s = Sampler(load_hf(qwen35_hf["qwen3_5"], mesh=mesh), SamplingParams(temperature=0.8),
                buckets=BUCKETS, mesh=mesh, layout=layout)
    reps = s.row_multiple // 3                 # fsdp, tp: 3 rows; replicated: 6 (prompts twice)
    prompts, seeds = qwen35_prompts * reps, [5, 6, 7] * reps
    cache, _ = s.new_cache(3 * reps, 64)
    assert cache.state.sharding == s.layout.sharding(LAYER_HEADS) and cache.state.dtype == jnp.float32
    assert cache.conv.sharding == s.layout.sharding(LAYER_HEADS)
    assert cache.conv.shape == (4, 3 * reps, 136, 3) and cache.k.shape == (1, 3 * reps, 64, 2, 32)
    out = s.generate(prompts, 6, seeds=seeds, cache_len=64)
    ref = qwen35_sampler.generate(qwen35_prompts, 6, seeds=[5, 6, 7], cache_len=64)
    for r in range(reps):
        np.testing.assert_array_equal(out["tokens"][3 * r:3 * r + 3], ref["tokens"])
        np.testing.assert_allclose(out["logprobs"][3 * r:3 * r + 3], ref["logprobs"], atol=1e-5, rtol=0)



@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_rollout_samples_the_policy_the_trainer_recomputes(tiny_hf, qwen35_hf, arch):
    """fp32 master weights, bf16 compute: the rollout copy cast every parameter to bf16, but
    Qwen3.5 reads its (1 + w) norms, gated norm, A_log, dt_bias and conv1d in fp32, so the
    sampler drew from another policy than GRPOStep recomputes (log-prob gap up to 0.09 nats
    here). The copy keeps those parameters' fp32 numbers now and casts only what the model
    reads in bf16; Qwen3 (norms read in bf16) agreed before and still does."""
    from jscenegen.model.weights import named_leaves
    from jscenegen.sharding.rules import rollout_casts

    d = tiny_hf["qwen3"] if arch == "qwen3" else qwen35_hf["qwen3_5"]
    model = load_hf(d, param_dtype="float32", compute_dtype="bfloat16")
    s = Sampler(model, SamplingParams(temperature=0.8), buckets=BUCKETS)
    master = named_leaves(nnx.split(model, nnx.Param, ...)[1])
    rollout = named_leaves(s.state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kept = {n for n in rollout if not rollout_casts(n)}
    assert {n.rsplit(".", 1)[-1] for n in kept} >= ({"weight", "A_log", "dt_bias"}
                                                     if arch == "qwen3_5" else {"weight"})
    for name, var in rollout.items():
        arr = np.asarray(var[...])
        if name in kept:
            assert arr.dtype == np.float32, name
            np.testing.assert_array_equal(arr, np.asarray(master[name]), err_msg=name)
        else:
            assert arr.dtype == jnp.bfloat16, name
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, model.cfg.vocab_size, n).tolist() for n in (11, 5, 3)]
    out = s.generate(prompts, 12, seeds=[5, 6, 7])
    assert out["lengths"].tolist() == [12, 12, 12]
    seqs = [p + out["tokens"][i].tolist() for i, p in enumerate(prompts)]
    want = trainer_logprobs(model, seqs, 0.8)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(out["logprobs"][i], want[i, len(p):len(p) + 12], atol=5e-6, rtol=0)

def test_a_turn_decoded_in_segments_is_the_turn_decoded_in_one_call(model, prompts):
    """Short segments (the cache, prompt + one segment of slots, growing after the first) give
    the tokens, log-probs, lengths and stop reasons of one 8-step call, greedy and sampled: a
    stop string spanning the last token of a segment and the first of the next still stops
    row 0; row 1 runs to its budget of 7. A budget beyond max_steps leaves the row running
    (reason none), as one call does."""
    ref = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS).generate(prompts, 8, [0, 0])["tokens"]
    vocab = [f"<{i}>".encode() for i in range(model.cfg.vocab_size)]
    stop = f"{int(ref[0, 2])}><{int(ref[0, 3])}"      # ends in a token's first bytes
    text0, text1 = (b"".join(vocab[t] for t in row).decode() for row in ref)
    end = text0.index(stop) + len(stop)
    expect = next(k + 1 for k in range(8) if len(b"".join(vocab[t] for t in ref[0, :k + 1])) >= end)
    assert 2 <= expect <= 4 and stop not in text1
    short = expect - 1                                 # a segment ends inside the stop string
    prompt = 16                                        # both prompts in one 16-slot bucket
    outs = {}
    for segment in sorted({short, 3, 16}):             # 3: 3 + 3 + a shorter last segment
        for params in (SamplingParams(greedy=True), SamplingParams(temperature=1.0)):
            s = Sampler(model, params, stop_strings=[stop], token_bytes=vocab, buckets=BUCKETS,
                        segment=segment)
            cache, last = s.new_cache(2, prompt + min(segment, 8))
            cache, last = s.append(cache, last, prompts)
            out = s.decode(cache, last, [8, 7], row_keys([5, 6]), 8, max_slots=prompt + 8)
            outs[segment, params.greedy] = out
            assert s.cache_grows == (segment < 8)
            assert int(out.cache.length) == prompt + max(np.asarray(out.lengths))
    for (segment, greedy), a in outs.items():
        b = outs[16, greedy]
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-6)
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
        np.testing.assert_array_equal(np.asarray(a.reason), np.asarray(b.reason))
    greedy = outs[short, True]
    assert np.asarray(greedy.reason).tolist() == [STOP_STRING, STOP_LENGTH]
    assert np.asarray(greedy.lengths).tolist() == [expect, 7]
    s = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS, segment=3)
    cache, last = s.new_cache(2, prompt + 8)
    cache, last = s.append(cache, last, prompts)
    out = s.decode(cache, last, [100, 8], row_keys([5, 6]), 8)
    assert np.asarray(out.reason).tolist() == [STOP_NONE, STOP_LENGTH]
    assert np.asarray(out.lengths).tolist() == [8, 8]


def test_a_decode_that_does_not_fit_the_cache_says_so(model, prompts):
    s = Sampler(model, SamplingParams(greedy=True), buckets=BUCKETS)
    cache, last = s.new_cache(2, 16)
    cache, last = s.append(cache, last, prompts)
    with pytest.raises(ValueError, match="6 steps need 22 cache slots; the cache has 16 and may grow to 20"):
        s.decode(cache, last, [6, 6], row_keys([1, 2]), 6, max_slots=20)
    with pytest.raises(ValueError, match="the cache has 16 \\(make room"):
        s.decode(cache, last, [6, 6], row_keys([1, 2]), 6)


@pytest.mark.parametrize("kwargs, config_message", [
    (dict(greedy=True, top_k=5), "but sampling.top_k is 5: set sampling.top_k=0 too"),
    (dict(greedy=True, top_p=0.9), "but sampling.top_p is 0.9: set sampling.top_p=1.0 too"),
])
def test_sampling_params_and_the_config_refuse_greedy_with_top_k_or_top_p(kwargs, config_message):
    with pytest.raises(ValueError, match="greedy sampling ignores top_k/top_p"):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=config_message):   # the config names the fix
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("buckets", [(), (32, 16), (16, 16), (0, 16)])
def test_sampler_and_config_refuse_the_same_buckets(model, buckets):
    with pytest.raises(ValueError, match="buckets must be increasing positive lengths"):
        Sampler(model, SamplingParams(greedy=True), buckets=buckets)
    with pytest.raises(ValueError, match="buckets must be increasing positive lengths"):
        SamplingConfig(buckets=buckets)


@pytest.mark.parametrize("temperature", [1e-3, MIN_TEMPERATURE])
def test_log_probs_at_small_temperatures_are_never_positive(model, prompts, temperature):
    """log_softmax(z / T) of a drawn token inside the decode loop: the token's and the row
    maximum's z = logits / T came out a few ulps apart at z ~ 1 / T (XLA fuses the two reads
    differently), so near-greedy draws returned log-probs up to +0.016 at T = 1e-5
    (helper-163). The difference is now taken on the raw logits: the argmax gives -log(norm)."""
    out = Sampler(model, SamplingParams(temperature=temperature), buckets=BUCKETS).generate(
        prompts, 12, seeds=[5, 6])
    lp = out["logprobs"]
    assert out["lengths"].tolist() == [12, 12]
    assert (lp <= 0).all(), lp.max()
    assert np.median(lp) > -1e-3   # near-greedy: most draws are the row's argmax


def test_an_empty_prompt_is_refused(model, prompts):
    """An empty row drew its first token from the cache's zero logits (uniform, log 1/V)."""
    s = Sampler(model, SamplingParams(), buckets=BUCKETS)
    with pytest.raises(ValueError, match="generate: prompt 1 is empty"):
        s.generate([prompts[0], []], 4, seeds=[0, 1])
    with pytest.raises(ValueError, match="generate: 1 seeds for 2 prompts; give one seed per "
                                         "prompt"):   # was a vmap error deep inside
        s.generate(prompts[:2], 4, seeds=[0])
    # the same through append + decode: a row with a budget and no token in the cache
    cache, last = s.append(*s.new_cache(2, 32), [prompts[0], []])
    with pytest.raises(ValueError, match="decode: row 1 has a budget of 4 tokens and no token in "
                                         "the cache to condition on"):
        s.decode(cache, last, [4, 4], row_keys([0, 1]), 4)
    out = s.decode(cache, last, [4, 0], row_keys([0, 1]), 4)   # no budget: it takes no part
    assert np.asarray(out.lengths).tolist() == [4, 0]


def test_buckets_must_be_multiples_of_the_smallest():
    """(16, 24) made a 17-token append 24 + 16 slots (two compiles, 40 slots where 24 fit)."""
    with pytest.raises(ValueError, match=r"buckets must be multiples of the smallest \(16\); 24 "
                                         r"is not \(got \[16, 24\]\)"):
        check_buckets((16, 24))
    assert split_into_buckets(17, check_buckets((16, 48))) == [16, 16]
    assert split_into_buckets(100, (16, 32, 64)) == [64, 32, 16]
