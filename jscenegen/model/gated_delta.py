"""The gated delta rule (Qwen3.5's Gated DeltaNet token mixer) as pure JAX functions.

Recurrence (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv:2412.06464, eq. 10; transformers `models/qwen3_5/modeling_qwen3_5.py`,
`torch_recurrent_gated_delta_rule`), per batch row and head, state S [Dk, Dv]:

    S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t / sqrt(Dk))

Convention (transformers' kernels after their `repeat_interleave` of q/k heads): q, k
[B, T, H, Dk]; v [B, T, H, Dv]; g [B, T, H] log decay (<= 0); beta [B, T, H]; state
[B, H, Dk, Dv] float32. The caller L2-normalises q and k and repeats key heads to value heads;
the kernels scale q by Dk**-0.5 themselves. Inputs of any float dtype are upcast: all math is
fp32 and outputs are fp32; matmuls ask for `Precision.HIGHEST` so accelerators keep fp32 too
(a no-op on CPU).

A position with beta = 0 and g = 0 leaves the state exactly unchanged (S * exp(0) + k * 0):
the model uses it for padded and masked positions.

The chunked form (`gated_delta_chunked`) is the WY/UT-transform algorithm of the paper (sec.
3.3) and of transformers' `torch_chunk_gated_delta_rule`: within a chunk of C positions, with
c_i = sum_{s <= i} g_s (from the chunk start) and D_ij = exp(sum_{j < s <= i} g_s) for j <= i,
the corrections u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) written into the state
(S_i = exp(g_i) S_{i-1} + k_i u_i^T) solve the unit lower-triangular system

    (I + A) U = beta V - (beta exp(c) K) S_0,      A_ij = beta_i (k_i . k_j) D_ij  (j < i)

and then o_i = exp(c_i) S_0^T q_i + sum_{j <= i} D_ij (q_i . k_j) u_j and
S_C = exp(c_C) S_0 + sum_j exp(c_C - c_j) k_j u_j^T. Unlike transformers, the decay sums
between two positions are summed directly (a "segment sum") rather than taken as differences of
chunk cumulative sums, which cancel when decays are strong (cumsums of -1e3 within a chunk): in
the tests' strong-decay cases transformers' chunked kernel is ~1e-6 (max|diff| / max|o|) from the
token-by-token rule, this one ~2e-7.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _mm(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_HI, preferred_element_type=jnp.float32)


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def _zero_state(k: jax.Array, v: jax.Array) -> jax.Array:
    return jnp.zeros((k.shape[0], k.shape[-2], k.shape[-1], v.shape[-1]), jnp.float32)


def gated_delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule (decode).

    q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv].
    Returns (o [B, H, Dv] float32, new state [B, H, Dk, Dv] float32), the update of
    transformers' `torch_recurrent_gated_delta_rule` loop body.
    """
    q, k, v, g, beta, state = _f32(q, k, v, g, beta, state)
    q = q * (q.shape[-1] ** -0.5)
    state = state * jnp.exp(g)[..., None, None]
    delta = beta[..., None] * (v - _mm("bhk,bhkv->bhv", k, state))
    state = state + k[..., :, None] * delta[..., None, :]
    return _mm("bhk,bhkv->bhv", q, state), state


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                          beta: jax.Array, initial_state: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (`lax.scan` of `gated_delta_step`): the reference.

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; initial_state [B, H, Dk, Dv] or
    None (zeros). Returns (o [B, T, H, Dv] float32, final state [B, H, Dk, Dv] float32).
    """
    state = _zero_state(k, v) if initial_state is None else jnp.asarray(initial_state, jnp.float32)

    def body(s, xs):
        o, s = gated_delta_step(*xs, s)
        return s, o

    xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    state, o = lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """Inverse of I + A for A [..., C, C] strictly lower triangular (the entries on and above
    the diagonal are ignored), by recursive block inversion, bottom-up:

        [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]],  X11 = L11^-1, X22 = L22^-1

    starting from 1 x 1 blocks (= 1) and doubling the block size, all blocks of a level in one
    batched matmul; C is padded to a power of two with identity rows. Exact in exact arithmetic;
    the tests compare it in fp32 with LAPACK's triangular solve (scipy). Used instead of
    `jax.scipy.linalg.solve_triangular`, whose CPU LAPACK trsm call (jaxlib 0.10.2) deadlocks
    XLA's intra-op thread pool on a 2-core host in a batched forward + backward; matmuls are
    also what accelerators run fastest and what autodiff differentiates plainly.
    Returns [..., C, C] float32, unit lower triangular.
    """
    c = a.shape[-1]
    p = 1 << max(c - 1, 0).bit_length()
    lower = jnp.tril(a, -1)
    if p != c:
        lower = jnp.pad(lower, [(0, 0)] * (a.ndim - 2) + [(0, p - c), (0, p - c)])
    batch = lower.shape[:-2]
    x = jnp.ones((*batch, p, 1, 1), jnp.float32)                # inverses of the 1 x 1 blocks
    s = 1
    while s < p:
        nb = p // (2 * s)
        blocks = lower.reshape(*batch, nb, 2 * s, nb, 2 * s)
        blocks = jnp.diagonal(blocks, axis1=-4, axis2=-2)       # [..., 2s, 2s, nb]
        l21 = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]         # [..., nb, s, s]
        x = x.reshape(*batch, nb, 2, s, s)
        x11, x22 = x[..., 0, :, :], x[..., 1, :, :]
        x21 = -_mm("...ij,...jk,...kl->...il", x22, l21, x11)
        zero = jnp.zeros_like(x11)
        x = jnp.concatenate([jnp.concatenate([x11, zero], -1),
                             jnp.concatenate([x21, x22], -1)], -2)
        s *= 2
    return x.reshape(*batch, p, p)[..., :c, :c]


def _to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, H, ...] with T = N * C -> [N, B, H, C, ...]."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t // chunk_size, chunk_size, h, *x.shape[3:])
    return jnp.moveaxis(x, (1, 2), (0, 3))


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                        beta: jax.Array, initial_state: jax.Array | None = None,
                        chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of `chunk_size` (training and prefill).

    Same arguments and results as `gated_delta_recurrent`: q, k [B, T, H, Dk]; v [B, T, H, Dv];
    g, beta [B, T, H]; initial_state [B, H, Dk, Dv] or None. Returns (o [B, T, H, Dv] float32,
    final state [B, H, Dk, Dv] float32). T is padded internally to a multiple of chunk_size with
    g = beta = 0 positions (which leave the state unchanged). Memory is O(T * (C + Dk + Dv)):
    the intra-chunk matrices are [C, C] per chunk, never [T, T]. Differentiable by plain
    autodiff (a `lax.scan` over chunks; the triangular systems are inverted with matmuls only,
    `unit_lower_inverse`). Raises ValueError if chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"gated_delta_chunked: chunk_size must be >= 1, got {chunk_size}")
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _f32(q, k, v, g, beta)
    state = _zero_state(k, v) if initial_state is None else jnp.asarray(initial_state, jnp.float32)
    pad = -t % chunk_size
    if pad:
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                            for x in (q, k, v, g, beta))
    q = q * (dk ** -0.5)
    q, k, v, g, beta = (_to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    # q, k [N, B, H, C, Dk]; v [N, B, H, C, Dv]; g, beta [N, B, H, C]

    c = chunk_size
    pos = jnp.arange(c)
    causal = pos[:, None] >= pos[None, :]                       # [C(i), C(j)] j <= i
    # seg[i, j] = sum_{j < s <= i} g_s, summed along i from j + 1 (no cancellation).
    seg = jnp.cumsum(jnp.where(pos[:, None] > pos[None, :], g[..., :, None], 0.0), axis=-2)
    decay = jnp.exp(jnp.where(causal, seg, -jnp.inf))          # D [N, B, H, C, C]
    cum = jnp.cumsum(g, axis=-1)                                # c_i [N, B, H, C]
    to_end = seg[..., -1, :]                                    # c_C - c_j [N, B, H, C]

    # (I + A)^-1 with A_ij = beta_i (k_i . k_j) D_ij, j < i (only the strict lower part is read)
    inv = unit_lower_inverse(beta[..., :, None] * _mm("...ik,...jk->...ij", k, k) * decay)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(cum))[..., None] * k], axis=-1)
    sol = _mm("...ij,...jd->...id", inv, rhs)
    w_v, w_k = sol[..., :dv], sol[..., dv:]                     # U = w_v - w_k @ S_0
    attn = _mm("...ik,...jk->...ij", q, k) * decay              # [N, B, H, C, C]
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(to_end)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]        # [N, B, H, 1, 1]

    def body(s, xs):
        w_v, w_k, attn, q_dec, k_dec, chunk_decay = xs
        u = w_v - _mm("bhck,bhkv->bhcv", w_k, s)
        o = _mm("bhck,bhkv->bhcv", q_dec, s) + _mm("bhij,bhjv->bhiv", attn, u)
        s = s * chunk_decay + _mm("bhck,bhcv->bhkv", k_dec, u)
        return s, o

    state, o = lax.scan(body, state, (w_v, w_k, attn, q_dec, k_dec, chunk_decay))
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, -1, h, dv)[:, :t]
    return o, state


def gated_delta_state_map(q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array,
                          chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """How a segment's outputs and final state depend on the state entering it.

    Both are affine in the entering state S0 [B, H, Dk, Dv] (for context-parallel shards):

        o(S0)     = o(0) + einsum("bthk,bhkv->bthv", q_eff, S0)
        final(S0) = einsum("bhkj,bhjv->bhkv", transition, S0) + final(0)

    q, k [B, T, H, Dk]; g, beta [B, T, H]. Returns (q_eff [B, T, H, Dk] float32,
    transition [B, H, Dk, Dk] float32): the chunked rule run with v = 0 (width Dk), whose
    output and final state are then linear in S0, from S0 = identity.
    """
    b, _, h, dk = k.shape
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
    zeros = jnp.zeros(k.shape, jnp.float32)
    return gated_delta_chunked(q, k, zeros, g, beta, eye, chunk_size)
