"""Kimi delta attention: every implementation against two oracles that share no code with
pallas_kernels/kda.py: a float64 numpy per-token loop written here, and HF transformers' own
torch KDA functions (`kimi_linear`'s recurrent and chunked ones; their fla fast path is not
installed, so HF runs its torch fallback)."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels import kda as kda_module
from pallas_kernels.kda import (
    kda,
    kda_chunked_reference,
    kda_gate,
    kda_normalize_qk,
    kda_recurrent_reference,
    kda_recurrent_step,
)
from pallas_kernels.kernel_impls import resolve

TOL = dict(rtol=2e-5, atol=2e-5)


def numpy_kda_oracle(q, k, v, g, beta, state):
    """float64 per-token, per-head loop: S = diag(e^g) S; S += k (beta (v - S^T k))^T; o = S^T q.
    q, k [T,Hk,K] (normalised, q scaled), v [T,H,V], g [T,H,K], beta [T,H], state [H,K,V]."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    state = np.array(state, np.float64)
    t_len, hk = q.shape[:2]
    h_len = v.shape[1]
    o = np.zeros(v.shape)
    for t in range(t_len):
        for h in range(h_len):
            kh = h // (h_len // hk)
            s = np.exp(g[t, h])[:, None] * state[h]
            u = beta[t, h] * (v[t, h] - s.T @ k[t, kh])
            state[h] = s + np.outer(k[t, kh], u)
            o[t, h] = state[h].T @ q[t, kh]
    return o, state


def numpy_normalize(q, k):
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    return l2(q) * q.shape[-1] ** -0.5, l2(k)


# log-decay regimes: "model" is HF's gate at its init ranges; "strong" reaches g ~ -60 per token
# (e^G underflows inside a chunk); "weak" is g ~ -1e-4 (almost no decay).
def random_decay(rng, shape, regime):
    if regime == "strong":
        return -rng.uniform(5.0, 60.0, size=shape)
    if regime == "weak":
        return -rng.uniform(0.0, 2e-4, size=shape)
    a = rng.uniform(1.0, 16.0, size=(shape[1], 1))  # exp(A_log)
    x = rng.normal(size=shape) - 4.0
    return -a * np.log1p(np.exp(x))


def random_kda_inputs(rng, t, hk, h, kd, vd, regime="model"):
    """Unit-norm q, k (q scaled), v, per-channel g <= 0, beta in (0,1), float32."""
    q, k = numpy_normalize(rng.normal(size=(t, hk, kd)), rng.normal(size=(t, hk, kd)))
    v = rng.normal(size=(t, h, vd))
    g = random_decay(rng, (t, h, kd), regime)
    beta = 1 / (1 + np.exp(-rng.normal(size=(t, h))))
    return [x.astype(np.float32) for x in (q, k, v, g, beta)]


def test_recurrent_reference_matches_numpy_oracle():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = random_kda_inputs(rng, 23, 2, 6, 8, 12)
    state = rng.normal(size=(6, 8, 12)).astype(np.float32)
    o, final = kda_recurrent_reference(q, k, v, g, beta, state)
    o_ref, final_ref = numpy_kda_oracle(q, k, v, g, beta, state)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(final, final_ref, **TOL)


@pytest.mark.parametrize("regime", ["model", "strong", "weak"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_chunked_reference_matches_numpy_oracle(length, regime):
    rng = np.random.default_rng(length * 3 + len(regime))
    hk, h, kd, vd = 1, 2, 8, 12
    inputs = random_kda_inputs(rng, length, hk, h, kd, vd, regime)
    state = rng.normal(size=(h, kd, vd)).astype(np.float32)
    o, final = kda_chunked_reference(*inputs, state, chunk_size=16)
    o_ref, final_ref = numpy_kda_oracle(*inputs, state)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(final, final_ref, **TOL)


def test_references_match_hf_torch_kda():
    """HF's recurrent (decode) and chunked (prefill) KDA, with their in-kernel l2norm and scale,
    against ours fed `kda_normalize_qk`'s output: outputs and final state, with an initial state,
    a length that is not a multiple of the chunk, and K != V."""
    torch = pytest.importorskip("torch")
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    rng = np.random.default_rng(1)
    t, h, kd, vd = 21, 2, 16, 8
    raw_q, raw_k = (rng.normal(size=(t, h, kd)).astype(np.float32) for _ in range(2))
    _, _, v, g, beta = random_kda_inputs(rng, t, h, h, kd, vd)
    state = rng.normal(size=(h, kd, vd)).astype(np.float32)
    to_torch = lambda x: torch.from_numpy(np.ascontiguousarray(x))[None]
    hf_args = [to_torch(x) for x in (raw_q, raw_k, v, g, beta)]
    with torch.no_grad():
        o_hf_rec, s_hf_rec = hf.recurrent_kimi_delta_attention(
            *hf_args, to_torch(state), True, use_qk_l2norm_in_kernel=True
        )
        o_hf_chk, s_hf_chk = hf.chunk_kimi_delta_attention(
            *hf_args[:3],
            g=hf_args[3],
            beta=hf_args[4],
            chunk_size=16,
            initial_state=to_torch(state),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    q, k = kda_normalize_qk(jnp.asarray(raw_q), jnp.asarray(raw_k))
    o_rec, s_rec = kda_recurrent_reference(q, k, v, g, beta, state)
    o_chk, s_chk = kda_chunked_reference(q, k, v, g, beta, state, chunk_size=16)
    for o, s in ((o_rec, s_rec), (o_chk, s_chk)):
        for o_hf, s_hf in ((o_hf_rec, s_hf_rec), (o_hf_chk, s_hf_chk)):
            np.testing.assert_allclose(o, o_hf[0].numpy(), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(s, s_hf[0].numpy(), rtol=1e-4, atol=1e-4)


def test_gate_matches_hf_forget_gate():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    torch.manual_seed(0)
    h, kd, hidden, t = 3, 8, 16, 5
    gate = hf.KimiLinearForgetGate(SimpleNamespace(linear_head_dim=kd, linear_num_heads=h, hidden_size=hidden))
    with torch.no_grad():
        for p in gate.parameters():
            p.normal_()
        gate.A_log.copy_(torch.rand(1, 1, h, 1) * 2.8)  # exp(A_log) in [1, 16], HF's init range
        gate.dt_bias.mul_(10.0)  # logits past the softplus cut-over at 20
        x = torch.randn(1, t, hidden)
        logits = gate.f_b_proj(gate.f_a_proj(x)).view(t, h, kd)
        g_hf = gate(x)[0].numpy()
    g = kda_gate(
        jnp.asarray(logits.numpy()), jnp.asarray(gate.A_log.detach().numpy().reshape(h)), gate.dt_bias.detach().numpy()
    )
    assert (np.asarray(g) <= 0).all()
    np.testing.assert_allclose(g, g_hf, rtol=1e-5, atol=1e-5)


def make_ragged_batch(rng, lengths, num_seq_slots, num_tokens, num_slots, hk, h, kd, vd, regime="model"):
    """A padded ragged batch; padding tokens are NaN and the null slot 0 holds NaN."""
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    assert cu[-1] <= num_tokens
    inputs = random_kda_inputs(rng, num_tokens, hk, h, kd, vd, regime)
    for x in inputs:
        x[cu[-1] :] = np.nan
    slots = np.zeros(num_seq_slots, np.int32)
    slots[: len(lengths)] = rng.choice(np.arange(1, num_slots), size=len(lengths), replace=False)
    has_init = np.zeros(num_seq_slots, bool)
    has_init[: len(lengths)] = np.arange(len(lengths)) % 2 == 0  # with and without initial state
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
        o_ref, state_ref = numpy_kda_oracle(*(x[rows] for x in inputs), init)
        np.testing.assert_allclose(o[rows], o_ref, err_msg=f"sequence {s}", **TOL)
        np.testing.assert_allclose(new_pool[slots[s]], state_ref, err_msg=f"slot of {s}", **TOL)
    written = {slots[s] for s, length in enumerate(lengths) if length}
    for slot in range(1, pool.shape[0]):
        if slot not in written:
            np.testing.assert_array_equal(new_pool[slot], pool[slot], err_msg=f"slot {slot}")
    assert np.isfinite(o).all(), "padding outputs must be zero, never NaN"


def run_ragged(batch, lengths, **kwargs):
    inputs, pool, cu, slots, has_init = batch
    return kda(
        *(jnp.asarray(x) for x in inputs),
        jnp.asarray(pool),
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_init),
        jnp.int32(len(lengths)),
        **kwargs,
    )


# A prompt with a ragged last chunk, decode rows, an empty row, a chunk-aligned prompt.
RAGGED_LENGTHS = [19, 1, 0, 16, 5, 1]


@pytest.mark.parametrize("regime", ["model", "strong", "weak"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_ragged_jnp_impls_match_oracle(impl, regime):
    rng = np.random.default_rng(len(regime))
    batch = make_ragged_batch(rng, RAGGED_LENGTHS, 8, 48, 10, 1, 2, 16, 8, regime)
    o, new_pool = run_ragged(batch, RAGGED_LENGTHS, impl=impl, chunk_size=8)
    assert_ragged_result(o, new_pool, *batch, RAGGED_LENGTHS)


@pytest.mark.parametrize(
    "interpret,regime", [("plain", "model"), ("plain", "strong"), ("plain", "weak"), ("tpu_simulator", "model")]
)
def test_tpu_kernel_matches_oracle_interpret(interpret, regime):
    """Chunks of 8: WY chunks for full chunks (19 = 2 x 8 + 3, 16), the per-token remainder."""
    rng = np.random.default_rng(5)
    batch = make_ragged_batch(rng, RAGGED_LENGTHS, 8, 48, 10, 1, 2, 16, 8, regime)
    mode = True if interpret == "plain" else pltpu.InterpretParams()
    try:
        o, new_pool = jax.block_until_ready(
            run_ragged(batch, RAGGED_LENGTHS, impl="pallas_tpu", interpret=mode, chunk_size=8)
        )
    finally:
        if interpret != "plain":
            pltpu.reset_tpu_interpret_mode_state()
    assert_ragged_result(o, new_pool, *batch, RAGGED_LENGTHS)


def test_tpu_kernel_pads_batches_shorter_than_a_window_with_gqa():
    rng = np.random.default_rng(6)
    lengths = [3, 1]
    batch = make_ragged_batch(rng, lengths, 2, 6, 4, 1, 3, 8, 16, "strong")
    o, new_pool = run_ragged(batch, lengths, impl="pallas_tpu", interpret=True, chunk_size=8)
    assert o.shape == (6, 3, 16)
    assert_ragged_result(o, new_pool, *batch, lengths)


def test_tpu_kernel_bf16_inputs_match_oracle():
    """bf16 q, k, v (g, beta, state stay f32): outputs come back in bf16, the state in f32."""
    rng = np.random.default_rng(9)
    lengths = [11, 1, 4]
    inputs, pool, cu, slots, has_init = make_ragged_batch(rng, lengths, 4, 24, 6, 1, 2, 16, 8)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in inputs[:3]]
    args = [*bf16, *(jnp.asarray(x) for x in inputs[3:])]
    meta = (jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(has_init), jnp.int32(len(lengths)))
    o, new_pool = kda(*args, jnp.asarray(pool), *meta, impl="pallas_tpu", interpret=True, chunk_size=8)
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
    rounded = [np.asarray(x.astype(jnp.float32)) for x in bf16] + inputs[3:]
    for s, length in enumerate(lengths):
        rows = slice(cu[s], cu[s] + length)
        init = pool[slots[s]] if has_init[s] else np.zeros_like(pool[slots[s]])
        o_ref, state_ref = numpy_kda_oracle(*(x[rows] for x in rounded), init)
        np.testing.assert_allclose(np.float32(o[rows]), o_ref, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(new_pool[slots[s]], state_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "impl,options",
    [
        ("reference", {}),
        ("chunked", {"chunk_size": 8}),
        ("pallas_tpu", {"interpret": True, "chunk_size": 8}),  # the state staged through a bf16 VMEM buffer
        ("pallas_gpu", {"interpret": gpu_kernel_interpret(), "chunk_size": 16}),
    ],
)
def test_bf16_slots_read_and_rounded_once_per_step(impl, options):
    """`cache.state_dtype` bfloat16: every impl reads a bf16 slot, carries the state in f32 through
    the step (chunk to chunk) and rounds only what it stores. Outputs equal the float64 oracle from
    the bf16 initial state at float32 tolerance; each written slot is the oracle's final state
    rounded once (half a bf16 ulp, 2^-9 relative: GDN's bound, tests/test_state_dtype.py); every
    other slot is untouched, bit for bit."""
    import ml_dtypes

    rng = np.random.default_rng(12)
    inputs, pool, cu, slots, has_init = make_ragged_batch(rng, RAGGED_LENGTHS, 8, 48, 10, 1, 2, 16, 32)
    pool = pool.astype(ml_dtypes.bfloat16)
    o, new_pool = run_ragged((inputs, pool, cu, slots, has_init), RAGGED_LENGTHS, impl=impl, **options)
    assert new_pool.dtype == jnp.bfloat16
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    written = set()
    for s, length in enumerate(RAGGED_LENGTHS):
        if not length:
            continue
        rows = slice(cu[s], cu[s] + length)
        init = pool[slots[s]].astype(np.float64) if has_init[s] else np.zeros(pool.shape[1:])
        o_ref, state_ref = numpy_kda_oracle(*(x[rows] for x in inputs), init)
        np.testing.assert_allclose(o[rows], o_ref, err_msg=f"sequence {s}", **TOL)
        np.testing.assert_allclose(new_pool[slots[s]].astype(np.float64), state_ref, rtol=2**-8, atol=2e-5)
        written.add(slots[s])
    for slot in set(range(1, pool.shape[0])) - written:
        np.testing.assert_array_equal(new_pool[slot].view(np.uint16), pool[slot].view(np.uint16))


@pytest.mark.parametrize("regime", ["model", "strong", "weak"])
def test_gpu_kernel_matches_oracle_interpret(regime):
    """Chunks of 16: WY chunks (37 = 2 x 16 + 5, 16) and the per-token remainder."""
    rng = np.random.default_rng(8)
    lengths = [37, 1, 0, 16, 3]
    inputs, pool, cu, slots, has_init = batch = make_ragged_batch(rng, lengths, 6, 64, 10, 1, 2, 16, 32, regime)
    from pallas_kernels.kda_kernel_gpu import kda_gpu

    o, new_pool = kda_gpu(
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


def test_decode_step_equals_one_token_of_prefill():
    """Prefill of T+1 tokens == prefill of T, then `kda_recurrent_step` and the ragged op's
    one-token row (every impl) from the carried state."""
    rng = np.random.default_rng(12)
    hk, h, kd, vd, t = 1, 2, 16, 8, 12
    inputs = random_kda_inputs(rng, t + 1, hk, h, kd, vd)
    state0 = rng.normal(size=(h, kd, vd)).astype(np.float32)
    o_full, s_full = numpy_kda_oracle(*inputs, state0)
    _, s_prefix = kda_chunked_reference(*(x[:t] for x in inputs), state0, chunk_size=8)
    last = [
        jnp.repeat(jnp.asarray(x[t]), h // hk, axis=0) if i < 2 else jnp.asarray(x[t]) for i, x in enumerate(inputs)
    ]
    s_step, o_step = kda_recurrent_step(s_prefix, *last)
    np.testing.assert_allclose(o_step, o_full[t], **TOL)
    np.testing.assert_allclose(s_step, s_full, **TOL)
    pool = jnp.stack([jnp.zeros_like(s_prefix), s_prefix])
    row = [jnp.asarray(x[t : t + 1]) for x in inputs]
    meta = (jnp.int32([0, 1]), jnp.int32([1]), jnp.bool_([True]), jnp.int32(1))
    for impl, options in (("reference", {}), ("chunked", {}), ("pallas_tpu", dict(interpret=True, chunk_size=8))):
        o, new_pool = kda(*row, pool, *meta, impl=impl, **options)
        np.testing.assert_allclose(o[0], o_full[t], err_msg=impl, **TOL)
        np.testing.assert_allclose(new_pool[1], s_full, err_msg=impl, **TOL)


def test_split_prefill_equals_one_call():
    rng = np.random.default_rng(11)
    hk, h, kd, vd, length, split, bucket = 1, 2, 8, 12, 40, 27, 48
    inputs = random_kda_inputs(rng, length, hk, h, kd, vd)
    pool = jnp.zeros((2, h, kd, vd), jnp.float32)

    def call(xs, pool, continues):  # every call padded to the same token bucket: one compile
        n = len(xs[0])
        padded = [np.concatenate([x, np.full((bucket - n,) + x.shape[1:], np.nan, x.dtype)]) for x in xs]
        meta = (jnp.int32([0, n]), jnp.int32([1]), jnp.bool_([continues]), jnp.int32([1]))
        o, pool = kda(*(jnp.asarray(x) for x in padded), pool, *meta, impl="chunked", chunk_size=8)
        return o[:n], pool

    o_full, pool_full = call(inputs, pool, False)
    o_a, pool_a = call([x[:split] for x in inputs], pool, False)
    o_b, pool_b = call([x[split:] for x in inputs], pool_a, True)
    np.testing.assert_allclose(jnp.concatenate([o_a, o_b]), o_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pool_b[1], pool_full[1], rtol=1e-5, atol=1e-5)
    o_ref, s_ref = numpy_kda_oracle(*inputs, np.zeros((h, kd, vd)))
    np.testing.assert_allclose(o_full, o_ref, **TOL)
    np.testing.assert_allclose(pool_full[1], s_ref, **TOL)


def test_auto_and_unknown_names():
    assert resolve(kda_module.KERNELS, "auto", "cpu") == "reference"
    assert resolve(kda_module.KERNELS, "auto", "cpu", interpret=True) == "pallas"
    assert resolve(kda_module.KERNELS, "auto", "tpu") == resolve(kda_module.KERNELS, "auto", "gpu") == "pallas"
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    meta = (jnp.int32([0, 4]), jnp.int32([1]), jnp.bool_([False]), jnp.int32(1))
    with pytest.raises(ValueError, match="unknown impl 'nope'"):
        kda(
            zeros(4, 1, 8),
            zeros(4, 1, 8),
            zeros(4, 2, 8),
            zeros(4, 2, 8),
            zeros(4, 2),
            zeros(2, 2, 8, 8),
            *meta,
            impl="nope",
        )
    with pytest.raises(ValueError, match="bad shapes"):  # a GDN-style scalar decay [T,H]
        kda(zeros(4, 1, 8), zeros(4, 1, 8), zeros(4, 2, 8), zeros(4, 2), zeros(4, 2), zeros(2, 2, 8, 8), *meta)
    with pytest.raises(ValueError, match="does not match"):
        kda(zeros(4, 1, 8), zeros(4, 1, 8), zeros(4, 2, 8), zeros(4, 2, 8), zeros(4, 2), zeros(2, 2, 8, 4), *meta)


def abstract_args(t=256, hk=2, h=4, kd=128, vd=128, s=8, n=16, sharding=None):
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return (
        sd((t, hk, kd), jnp.bfloat16),
        sd((t, hk, kd), jnp.bfloat16),
        sd((t, h, vd), jnp.bfloat16),
        sd((t, h, kd), jnp.float32),
        sd((t, h), jnp.float32),
        sd((n, h, kd, vd), jnp.float32),
        sd((s + 1,), jnp.int32),
        sd((s,), jnp.int32),
        sd((s,), jnp.bool_),
        sd((), jnp.int32),
    )


def test_tpu_kernel_lowers_for_tpu():
    fn = lambda *a: kda(*a, impl="pallas_tpu")
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*abstract_args())
    assert "tpu_custom_call" in exported.mlir_module()


def test_gpu_kernel_lowers_for_cuda():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    fn = lambda *a: kda(*a, impl="pallas_gpu")
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*abstract_args()).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_tpu_kernel_compiles_with_mosaic(chip):
    """libtpu's real Mosaic compiler, ahead of time on CPU (as tests/test_kernels_tpu_aot.py):
    interpret mode ignores TPU tiling rules. K = V = 128, chunk 64, bf16 q/k/v."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        topology = topologies.get_topology_desc(f"{chip}=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    except Exception as error:  # no libtpu in this environment
        pytest.skip(f"no TPU topology (libtpu) here: {error}")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    fn = lambda *a: kda(*a, impl="pallas_tpu", chunk_size=64)
    compiled = jax.jit(fn).trace(*abstract_args(t=200, n=9, sharding=sharding)).lower().compile()
    out, state = compiled.out_info
    assert out.shape == (200, 4, 128) and state.shape == (9, 4, 128, 128)
