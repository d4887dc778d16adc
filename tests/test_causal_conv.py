"""jscenegen.model.causal_conv: the conv state algebra that lets sequence shards start their
causal conv where the unsharded row would be (against causal_conv over the whole row; the conv
itself is compared with transformers in tests/test_model_qwen35.py)."""
import jax
import jax.numpy as jnp
import numpy as np

from jscenegen.model.causal_conv import causal_conv, conv_state_prefix, fold_conv_state, last_real_inputs

K, C = 4, 5
conv = jax.jit(causal_conv)


def _rows():
    """5 rows of 24 positions cut into 4 segments of 6: padding left, right, in the middle,
    a segment with 1 real token (n < K-1 shifts the older state), a row with none."""
    rng = np.random.default_rng(3)
    u = rng.standard_normal((5, 24, C)).astype(np.float32)
    mask = np.ones((5, 24), bool)
    mask[1, :10] = False          # left padding: segment 0 empty, segment 1 has 2 real tokens
    mask[2, 15:] = False          # right padding
    mask[3, 7:12] = False         # padding inside: segment 1 has 1 real token
    mask[3, 13:17] = False
    mask[4] = False               # no real token at all
    return u, mask


def test_segment_states_fold_to_the_whole_rows_states_and_outputs():
    u, mask = _rows()
    w = np.random.default_rng(4).standard_normal((C, K)).astype(np.float32)
    initial = np.random.default_rng(5).standard_normal((5, C, K - 1)).astype(np.float32)
    y_whole, s_whole = conv(jnp.asarray(u), jnp.asarray(mask), jnp.asarray(w), jnp.asarray(initial))
    segs = [slice(6 * i, 6 * (i + 1)) for i in range(4)]
    summary = jax.jit(last_real_inputs, static_argnums=2)
    summaries = [summary(jnp.asarray(u[:, s]), jnp.asarray(mask[:, s]), K) for s in segs]
    tails = jnp.stack([t for t, _ in summaries])
    counts = jnp.stack([n for _, n in summaries])
    assert counts[:, 1].tolist() == [0, 2, 6, 6] and counts[:, 3].tolist() == [6, 1, 2, 6]
    entering = jax.jit(conv_state_prefix)(tails, counts, jnp.asarray(initial))
    ys = []
    for i, s in enumerate(segs):
        # the state entering segment i is the whole row's conv state after segments < i
        _, want = conv(jnp.asarray(u[:, :s.start]), jnp.asarray(mask[:, :s.start]),
                              jnp.asarray(w), jnp.asarray(initial))
        np.testing.assert_array_equal(entering[i], want)
        y, _ = conv(jnp.asarray(u[:, s]), jnp.asarray(mask[:, s]), jnp.asarray(w), entering[i])
        ys.append(y)
    np.testing.assert_array_equal(entering[4], s_whole)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), y_whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(entering[4][4], initial[4])  # no real token: unchanged


def test_fold_keeps_older_inputs_when_a_segment_is_short():
    state = jnp.asarray(np.arange(2 * 3, dtype=np.float32).reshape(1, 2, 3))  # inputs 0,1,2 / 3,4,5
    tail = jnp.asarray(np.array([[[0, 0, 9], [0, 0, 8]]], np.float32))       # one new input
    out = fold_conv_state(state, tail, jnp.asarray([1]))
    np.testing.assert_array_equal(out[0], [[1, 2, 9], [4, 5, 8]])
    np.testing.assert_array_equal(fold_conv_state(state, tail, jnp.asarray([0]))[0], state[0])
