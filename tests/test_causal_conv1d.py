"""Causal conv1d: reference vs a float64 numpy loop, ragged op vs per-sequence reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.causal_conv1d import causal_conv1d, causal_conv1d_reference


def numpy_conv_oracle(x, weight, state, activation):
    """float64 loop: y_t = act(sum_j w[:, j] * x_{t-W+1+j}), history seeded by state."""
    width = weight.shape[1]
    history = [row for row in state] + [row for row in x]
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        acc = np.zeros(x.shape[1])
        for j in range(width):
            acc += weight[:, j] * history[t + j]
        y[t] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
    return y, np.stack(history[len(history) - (width - 1) :])


@pytest.mark.parametrize("length", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("activation", ["silu", None])
def test_reference_matches_numpy_oracle(length, activation):
    rng = np.random.default_rng(length)
    c, width = 5, 4
    x, w = rng.normal(size=(length, c)), rng.normal(size=(c, width))
    state = rng.normal(size=(width - 1, c))
    y, new_state = causal_conv1d_reference(jnp.float32(x), jnp.float32(w), jnp.float32(state), activation=activation)
    y_ref, state_ref = numpy_conv_oracle(x, w, state, activation)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state, state_ref, rtol=1e-6, atol=1e-6)


def random_ragged_batch(rng, lengths, num_seq_slots, num_tokens, num_slots):
    """cu_q_lens [S+1], slot ids [S] (distinct, >= 1; 0 for padding), has_initial_state [S]."""
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    assert cu[-1] <= num_tokens
    slots = np.zeros(num_seq_slots, np.int32)
    slots[: len(lengths)] = rng.choice(np.arange(1, num_slots), size=len(lengths), replace=False)
    has_init = rng.random(num_seq_slots) < 0.5
    return cu, slots, has_init


@pytest.mark.parametrize("lengths", [[1], [5, 1, 2, 9, 1], [3, 0, 17, 1, 1, 2]])
@pytest.mark.parametrize("width", [2, 4])
def test_ragged_matches_per_sequence_reference(lengths, width):
    rng = np.random.default_rng(len(lengths) * 10 + width)
    c, num_seq_slots, num_tokens, num_slots = 6, 8, 32, 12
    cu, slots, has_init = random_ragged_batch(rng, lengths, num_seq_slots, num_tokens, num_slots)
    x = rng.normal(size=(num_tokens, c)).astype(np.float32)
    x[cu[len(lengths)] :] = np.nan  # padding tokens are poisoned
    w = rng.normal(size=(c, width)).astype(np.float32)
    pool = rng.normal(size=(num_slots, width - 1, c)).astype(np.float32)
    pool[0] = np.nan  # the null slot may hold garbage

    y, new_pool = causal_conv1d(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(pool),
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_init),
        jnp.int32(len(lengths)),
    )
    y, new_pool = np.asarray(y), np.asarray(new_pool)

    touched = set()
    for s, length in enumerate(lengths):
        if length == 0:
            continue
        start, slot = cu[s], slots[s]
        init = pool[slot] if has_init[s] else np.zeros_like(pool[slot])
        y_ref, state_ref = numpy_conv_oracle(x[start : start + length].astype(np.float64), w, init, "silu")
        np.testing.assert_allclose(y[start : start + length], y_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_pool[slot], state_ref, rtol=1e-6, atol=1e-6)
        touched.add(slot)
    for slot in range(1, num_slots):
        if slot not in touched:  # unused and empty-sequence slots unchanged
            np.testing.assert_array_equal(new_pool[slot], pool[slot])
    assert np.isfinite(y[: cu[len(lengths)]]).all()
    assert np.isfinite(y).all()


def test_split_prefill_equals_one_call():
    rng = np.random.default_rng(7)
    c, width, length, split = 4, 4, 11, 2  # first part shorter than W-1
    x = jnp.float32(rng.normal(size=(length, c)))
    w = jnp.float32(rng.normal(size=(c, width)))
    pool = jnp.zeros((2, width - 1, c), jnp.float32)

    def one_sequence(n, continues):
        return jnp.int32([0, n]), jnp.int32([1]), jnp.bool_([continues]), jnp.int32(1)

    y_full, pool_full = causal_conv1d(x, w, pool, *one_sequence(length, False))
    y_a, pool_a = causal_conv1d(x[:split], w, pool, *one_sequence(split, False))
    y_b, pool_b = causal_conv1d(x[split:], w, pool_a, *one_sequence(length - split, True))
    np.testing.assert_allclose(jnp.concatenate([y_a, y_b]), y_full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pool_b, pool_full, rtol=0, atol=0)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        causal_conv1d(
            jnp.zeros((4, 3)),
            jnp.zeros((3, 4)),
            jnp.zeros((2, 2, 3)),
            jnp.int32([0, 4]),
            jnp.int32([1]),
            jnp.bool_([False]),
            jnp.int32(1),
        )
