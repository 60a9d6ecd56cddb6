"""Gated delta rule: recurrent ⇄ chunked ⇄ ragged op ⇄ Pallas kernels, all against a float64
numpy loop of the recurrence (an oracle that shares no code with pallas_kernels/gdn.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels import gdn
from pallas_kernels.gdn import gated_delta_rule, gdn_chunked_reference, gdn_recurrent_reference

TOL = dict(rtol=2e-5, atol=2e-5)


def numpy_gdn_oracle(q, k, v, g, beta, state):
    """float64 per-token, per-head loop of GDN.md's recurrence. q,k [T,Hk,K] ... -> (o, state)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    state = np.array(state, np.float64)
    t_len, hk = q.shape[:2]
    h_len = v.shape[1]
    o = np.zeros(v.shape)
    for t in range(t_len):
        for h in range(h_len):
            kh = h // (h_len // hk)
            s = np.exp(g[t, h]) * state[h]
            u = beta[t, h] * (v[t, h] - s.T @ k[t, kh])
            state[h] = s + np.outer(k[t, kh], u)
            o[t, h] = state[h].T @ q[t, kh]
    return o, state


def random_gdn_inputs(rng, t, hk, h, kd, vd):
    """Inputs with the model's statistics: unit-norm q, k (q scaled), g <= 0, beta in (0,1)."""

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q = l2(rng.normal(size=(t, hk, kd))) * kd**-0.5
    k = l2(rng.normal(size=(t, hk, kd)))
    v = rng.normal(size=(t, h, vd))
    g = -np.log1p(np.exp(rng.normal(size=(t, h)))) * rng.uniform(0.01, 1.0, size=(1, h))
    beta = 1 / (1 + np.exp(-rng.normal(size=(t, h))))
    return [x.astype(np.float32) for x in (q, k, v, g, beta)]


def test_recurrent_reference_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = random_gdn_inputs(rng, 23, 2, 6, 8, 12)
    state = rng.normal(size=(6, 8, 12)).astype(np.float32)
    o, final = gdn_recurrent_reference(q, k, v, g, beta, state)
    o_ref, final_ref = numpy_gdn_oracle(q, k, v, g, beta, state)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(final, final_ref, **TOL)


@pytest.mark.parametrize("length", [1, 15, 63, 64, 65, 130, 300])
@pytest.mark.parametrize("heads_per_key_head", [1, 3])
def test_chunked_reference_matches_recurrent(length, heads_per_key_head):
    rng = np.random.default_rng(length * 7 + heads_per_key_head)
    hk, kd, vd = 2, 16, 24
    h = hk * heads_per_key_head
    inputs = random_gdn_inputs(rng, length, hk, h, kd, vd)
    state = rng.normal(size=(h, kd, vd)).astype(np.float32)
    o_rec, s_rec = gdn_recurrent_reference(*inputs, state)
    o_chk, s_chk = gdn_chunked_reference(*inputs, state, chunk_size=64)
    np.testing.assert_allclose(o_chk, o_rec, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_chk, s_rec, rtol=1e-5, atol=1e-5)


def test_chunked_reference_matches_numpy_oracle_small_chunks():
    rng = np.random.default_rng(3)
    inputs = random_gdn_inputs(rng, 37, 1, 2, 8, 4)
    state = rng.normal(size=(2, 8, 4)).astype(np.float32)
    o, final = gdn_chunked_reference(*inputs, state, chunk_size=8)
    o_ref, final_ref = numpy_gdn_oracle(*inputs, state)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(final, final_ref, **TOL)


def make_ragged_batch(rng, lengths, num_seq_slots, num_tokens, num_slots, hk, h, kd, vd):
    """A padded ragged batch; padding tokens are NaN and the null slot 0 holds NaN."""
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    assert cu[-1] <= num_tokens
    inputs = random_gdn_inputs(rng, num_tokens, hk, h, kd, vd)
    for x in inputs:
        x[cu[-1] :] = np.nan
    slots = np.zeros(num_seq_slots, np.int32)
    slots[: len(lengths)] = rng.choice(np.arange(1, num_slots), size=len(lengths), replace=False)
    has_init = np.zeros(num_seq_slots, bool)
    has_init[: len(lengths)] = rng.random(len(lengths)) < 0.5
    pool = rng.normal(size=(num_slots, h, kd, vd)).astype(np.float32)
    pool[0] = np.nan
    return inputs, pool, cu, slots, has_init


def assert_ragged_result(o, new_pool, inputs, pool, cu, slots, has_init, lengths):
    """Every real sequence matches the float64 oracle; no other real slot changed."""
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    for s, length in enumerate(lengths):
        if length == 0:
            continue
        rows = slice(cu[s], cu[s] + length)
        init = pool[slots[s]] if has_init[s] else np.zeros_like(pool[slots[s]])
        o_ref, state_ref = numpy_gdn_oracle(*(x[rows] for x in inputs), init)
        np.testing.assert_allclose(o[rows], o_ref, err_msg=f"sequence {s}", **TOL)
        np.testing.assert_allclose(new_pool[slots[s]], state_ref, err_msg=f"slot of {s}", **TOL)
    written = {slots[s] for s, length in enumerate(lengths) if length}
    for slot in range(1, pool.shape[0]):
        if slot not in written:
            np.testing.assert_array_equal(new_pool[slot], pool[slot], err_msg=f"slot {slot}")
    assert np.isfinite(o).all(), "padding outputs must be zero, never NaN"


def run_ragged(batch, lengths, **kwargs):
    inputs, pool, cu, slots, has_init = batch
    return gated_delta_rule(
        *(jnp.asarray(x) for x in inputs),
        jnp.asarray(pool),
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_init),
        jnp.int32(len(lengths)),
        **kwargs,
    )


@pytest.mark.parametrize(
    "lengths,heads_per_key_head",
    [
        ([1, 1, 1], 1),  # pure decode: the batched one-step path
        ([1, 0, 1, 1], 2),  # an empty sequence: token i is no longer sequence i
        ([5, 1, 0, 70, 1, 12], 3),
        ([130, 1], 2),
    ],
)
@pytest.mark.parametrize("impl", ["reference", "reference_chunked", "chunked", "native"])
def test_ragged_reference_matches_per_sequence_oracle(lengths, heads_per_key_head, impl):
    rng = np.random.default_rng(sum(lengths))
    hk, kd, vd = 1, 8, 12
    h = hk * heads_per_key_head
    batch = make_ragged_batch(rng, lengths, 8, 160, 10, hk, h, kd, vd)
    o, new_pool = run_ragged(batch, lengths, impl=impl, chunk_size=16)
    assert_ragged_result(o, new_pool, *batch, lengths)


@pytest.mark.parametrize(
    "lengths",
    [
        [100, 1, 1, 0, 1, 17],  # a prompt, decode rows, an empty row, a short prompt
        [1] * 7,  # decode only in a prefill-sized bucket
        [16, 32, 2, 1],  # prompts ending on chunk boundaries, a two-token row
    ],
)
@pytest.mark.parametrize("impl", ["chunked", "native"])
@pytest.mark.parametrize("bucket", [gdn.CHUNKED_MIN_TOKENS, 120])
def test_cpu_chunked_path_matches_per_token_recurrence(lengths, impl, bucket):
    """impl="chunked" / "native" from CHUNKED_MIN_TOKENS on (WY rows + batched or C++ one-token
    rows) and below it (per-token loop / C++ for every row) against the per-token loop, on a padded
    (NaN) ragged step with initial states (V = 128 takes the C++ kernel's fixed-width loop)."""
    rng = np.random.default_rng(len(lengths))
    batch = make_ragged_batch(rng, lengths, 8, bucket, 10, 2, 4, 32, 128)
    o_ref, pool_ref = run_ragged(batch, lengths, impl="reference")
    o, pool = run_ragged(batch, lengths, impl=impl)
    real = int(sum(lengths))
    np.testing.assert_allclose(np.asarray(o)[:real], np.asarray(o_ref)[:real], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(pool)[1:], np.asarray(pool_ref)[1:], rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(o)).all()


def test_split_prefill_equals_one_call():
    rng = np.random.default_rng(11)
    hk, h, kd, vd, length, split, bucket = 1, 2, 8, 12, 90, 67, 96
    inputs = random_gdn_inputs(rng, length, hk, h, kd, vd)
    pool = jnp.zeros((2, h, kd, vd), jnp.float32)

    def call(xs, pool, continues):  # every call padded to the same token bucket: one compile
        n = len(xs[0])
        padded = [np.concatenate([x, np.full((bucket - n,) + x.shape[1:], np.nan, x.dtype)]) for x in xs]
        o, pool = gated_delta_rule(
            *(jnp.asarray(x) for x in padded),
            pool,
            jnp.int32([0, n]),
            jnp.int32([1]),
            jnp.bool_([continues]),
            jnp.int32([1]),
        )
        return o[:n], pool

    o_full, pool_full = call(inputs, pool, False)
    o_a, pool_a = call([x[:split] for x in inputs], pool, False)
    o_b, pool_b = call([x[split:] for x in inputs], pool_a, True)
    np.testing.assert_allclose(jnp.concatenate([o_a, o_b]), o_full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pool_b[1], pool_full[1], rtol=1e-6, atol=1e-6)
    o_chk, s_chk = gdn_chunked_reference(*(x[:split] for x in inputs), pool[1], chunk_size=16)
    o_chk2, s_chk2 = gdn_chunked_reference(*(x[split:] for x in inputs), s_chk, chunk_size=16)
    np.testing.assert_allclose(jnp.concatenate([o_chk, o_chk2]), o_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_chk2, pool_full[1], rtol=1e-5, atol=1e-5)


# Tiny kernel batches: full chunks + remainder (19 = 2*8+3), decode tokens, an empty sequence,
# a sequence ending exactly on a chunk boundary, and padded sequence slots.
KERNEL_LENGTHS = [19, 1, 0, 16, 5, 1]


@pytest.mark.parametrize("interpret", ["plain", "tpu_simulator"])
def test_tpu_kernel_matches_oracle_interpret(interpret):
    rng = np.random.default_rng(5)
    batch = make_ragged_batch(rng, KERNEL_LENGTHS, 8, 48, 10, 1, 2, 16, 8)
    mode = True if interpret == "plain" else pltpu.InterpretParams()
    try:
        o, new_pool = run_ragged(batch, KERNEL_LENGTHS, impl="pallas_tpu", interpret=mode, chunk_size=8)
        o, new_pool = jax.block_until_ready((o, new_pool))
    finally:
        if interpret != "plain":
            pltpu.reset_tpu_interpret_mode_state()
    assert_ragged_result(o, new_pool, *batch, KERNEL_LENGTHS)


def test_tpu_kernel_pads_batches_shorter_than_a_chunk():
    rng = np.random.default_rng(6)
    lengths = [3, 1]
    batch = make_ragged_batch(rng, lengths, 2, 6, 4, 2, 2, 8, 8)
    o, new_pool = run_ragged(batch, lengths, impl="pallas_tpu", interpret=True, chunk_size=8)
    assert o.shape == (6, 2, 8)
    assert_ragged_result(o, new_pool, *batch, lengths)


def test_tpu_kernel_bf16_inputs_match_reference():
    rng = np.random.default_rng(9)
    lengths = [11, 1, 4]
    inputs, pool, cu, slots, has_init = make_ragged_batch(rng, lengths, 4, 24, 6, 1, 2, 16, 8)
    args = [jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]] + [jnp.asarray(x) for x in inputs[3:]]
    args += [jnp.asarray(pool), jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(has_init), jnp.int32(len(lengths))]
    o_ref, pool_ref = gated_delta_rule(*args)
    o, new_pool = gated_delta_rule(*args, impl="pallas_tpu", interpret=True, chunk_size=8)
    assert o.dtype == jnp.bfloat16
    valid = slice(0, cu[len(lengths)])
    np.testing.assert_allclose(np.float32(o[valid]), np.float32(o_ref[valid]), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(new_pool[1:], pool_ref[1:], rtol=1e-5, atol=1e-5)


def test_gpu_kernel_matches_oracle_interpret():
    rng = np.random.default_rng(8)
    lengths = [37, 1, 0, 16, 3]
    batch = make_ragged_batch(rng, lengths, 6, 64, 10, 1, 2, 16, 32)
    inputs, pool, cu, slots, has_init = batch
    from pallas_kernels.gdn_kernel_gpu import gated_delta_rule_gpu

    o, new_pool = gated_delta_rule_gpu(
        *(jnp.asarray(x) for x in inputs),
        jnp.asarray(pool),
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_init.astype(np.int32)),
        jnp.int32([len(lengths)]),
        interpret=gpu_kernel_interpret(),
        chunk_size=16,
        block_v=16,
    )
    assert_ragged_result(o, new_pool, *batch, lengths)


def abstract_args(t=256, hk=2, h=4, kd=128, vd=128, s=8, n=16):
    sd = jax.ShapeDtypeStruct
    return (
        sd((t, hk, kd), jnp.bfloat16),
        sd((t, hk, kd), jnp.bfloat16),
        sd((t, h, vd), jnp.bfloat16),
        sd((t, h), jnp.float32),
        sd((t, h), jnp.float32),
        sd((n, h, kd, vd), jnp.float32),
        sd((s + 1,), jnp.int32),
        sd((s,), jnp.int32),
        sd((s,), jnp.bool_),
        sd((), jnp.int32),
    )


def test_tpu_kernel_lowers_for_tpu():
    fn = lambda *a: gated_delta_rule(*a, impl="pallas_tpu")
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*abstract_args())
    assert "tpu_custom_call" in exported.mlir_module()


def test_gpu_kernel_lowers_for_cuda():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    fn = lambda *a: gated_delta_rule(*a, impl="pallas_gpu")
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*abstract_args()).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_rejects_mismatched_state():
    with pytest.raises(ValueError):
        gated_delta_rule(
            jnp.zeros((4, 1, 8)),
            jnp.zeros((4, 1, 8)),
            jnp.zeros((4, 2, 8)),
            jnp.zeros((4, 2)),
            jnp.zeros((4, 2)),
            jnp.zeros((3, 2, 8, 4)),
            jnp.int32([0, 4]),
            jnp.int32([1]),
            jnp.bool_([False]),
            jnp.int32(1),
        )
