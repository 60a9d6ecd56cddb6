"""Mamba-2 SSD scan: every implementation against two oracles that share no code with
pallas_kernels/ssd.py: a float64 numpy per-token loop written here, and HF transformers' own
torch code (`nemotron_h`'s `mamba2_chunk_scan`, `mamba2_selective_state_update` and a whole
`NemotronHMamba2Mixer`; mamba_ssm is not installed, so HF runs its torch fallback)."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import gpu_kernel_interpret

from pallas_kernels import ssd as ssd_module
from pallas_kernels.kernel_impls import resolve
from pallas_kernels.ssd import ssd, ssd_dt, ssd_recurrent_step

TOL = dict(rtol=5e-5, atol=5e-5)


def numpy_dt(dt, dt_bias, dt_limit=(0.0, np.inf)):
    return np.clip(np.logaddexp(0.0, np.asarray(dt, np.float64) + dt_bias), *dt_limit)


def numpy_ssd_oracle(x, dt, a, b, c, d, dt_bias, state, dt_limit=(0.0, np.inf)):
    """float64 per-token, per-head loop on raw dt: dt = clip(softplus(dt + bias)),
    S = exp(dt a) S + dt x B^T, y = S C + D x. x [T,H,P], b/c [T,G,N], state [H,P,N]."""
    x, a, b, c, d = (np.asarray(v, np.float64) for v in (x, a, b, c, d))
    dt = numpy_dt(dt, dt_bias, dt_limit)
    state = np.array(state, np.float64)
    t_len, h_len = dt.shape
    heads_per_group = h_len // b.shape[1]
    y = np.zeros(x.shape)
    for t in range(t_len):
        for h in range(h_len):
            g = h // heads_per_group
            state[h] = np.exp(dt[t, h] * a[h]) * state[h] + dt[t, h] * np.outer(x[t, h], b[t, g])
            y[t, h] = state[h] @ c[t, g] + d[h] * x[t, h]
    return y, state


# decay regimes (per-token log-decay dt * A): "model" is HF's init (A = -(1..H), dt_bias 1,
# raw dt ~ N(0,1)); "strong" reaches dt A ~ -100 (exp underflows inside a chunk); "weak" has
# |dt A| ~ 1e-4 (the state barely forgets).
def random_params(rng, h, regime):
    if regime == "strong":
        a = -rng.uniform(20.0, 60.0, size=h)
    elif regime == "weak":
        a = -rng.uniform(1e-5, 1e-4, size=h)
    else:
        a = -np.arange(1, h + 1, dtype=np.float64)
    d = rng.normal(size=h)
    dt_bias = 1.0 + 0.5 * rng.normal(size=h)
    return [v.astype(np.float32) for v in (a, d, dt_bias)]


def random_tokens(rng, t, h, p, g, n):
    x = rng.normal(size=(t, h, p))
    dt = rng.normal(size=(t, h))
    b, c = (rng.normal(size=(t, g, n)) / np.sqrt(n) for _ in range(2))
    return [v.astype(np.float32) for v in (x, dt, b, c)]


def test_dt_processing_matches_torch():
    torch = pytest.importorskip("torch")
    raw = np.linspace(-30, 30, 61, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    bias = np.float32([0.5, -1.0])
    want = torch.clamp(torch.nn.functional.softplus(torch.from_numpy(raw + bias)), 1e-3, 5.0).numpy()
    np.testing.assert_allclose(ssd_dt(raw, bias, (1e-3, 5.0)), want, rtol=1e-6, atol=1e-7)


def run_single(inputs, params, state, **kwargs):
    """One sequence through the ragged op (slot 1, with initial state)."""
    x, dt, b, c = inputs
    a, d, dt_bias = params
    pool = jnp.stack([jnp.zeros_like(state), jnp.asarray(state)])
    meta = (jnp.int32([0, len(x)]), jnp.int32([1]), jnp.bool_([True]), jnp.int32(1))
    y, pool = ssd(x, dt, a, b, c, d, dt_bias, pool, *meta, **kwargs)
    return np.asarray(y), np.asarray(pool[1])


@pytest.mark.parametrize("groups", [1, 2])
def test_ops_match_hf_chunk_scan(groups):
    """HF's prefill scan (chunk 8, a ragged last chunk, an initial state, dt_limit) against the
    numpy oracle and every impl."""
    torch = pytest.importorskip("torch")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    rng = np.random.default_rng(groups)
    t, h, p, n, limit = 21, 4, 16, 16, (0.5, np.inf)  # the limit clamps about a third of dt
    inputs = random_tokens(rng, t, h, p, groups, n)
    params = random_params(rng, h, "model")
    state = rng.normal(size=(h, p, n)).astype(np.float32)
    x, dt, b, c = (torch.from_numpy(v)[None] for v in inputs)
    a, d, dt_bias = (torch.from_numpy(v) for v in params)
    with torch.no_grad():
        y_hf, s_hf = hf.mamba2_chunk_scan(
            x, dt, a, b, c, chunk_size=8, D=d, dt_bias=dt_bias, initial_states=torch.from_numpy(state)[None],
            dt_softplus=True, dt_limit=limit, return_final_states=True,
        )  # fmt: skip
    y_hf, s_hf = y_hf[0].numpy(), s_hf[0].numpy()
    y_np, s_np = numpy_ssd_oracle(*inputs[:2], params[0], *inputs[2:], *params[1:], state, limit)
    np.testing.assert_allclose(y_hf, y_np, rtol=1e-4, atol=1e-4)  # the two oracles agree
    np.testing.assert_allclose(s_hf, s_np, rtol=1e-4, atol=1e-4)
    for impl, options in (
        ("reference", {}),
        ("chunked", dict(chunk_size=8)),
        ("pallas_tpu", dict(interpret=True, chunk_size=8)),
        ("pallas_gpu", dict(interpret=gpu_kernel_interpret(), chunk_size=16)),
    ):
        y, s = run_single(inputs, params, state, impl=impl, dt_limit=limit, **options)
        np.testing.assert_allclose(y, y_hf, rtol=1e-4, atol=1e-4, err_msg=impl)
        np.testing.assert_allclose(s, s_hf, rtol=1e-4, atol=1e-4, err_msg=impl)


def test_decode_row_matches_hf_selective_state_update():
    """HF's decode path (its cache update, no dt clamp) == a one-token row of every impl."""
    torch = pytest.importorskip("torch")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    rng = np.random.default_rng(3)
    h, p, g, n = 4, 16, 2, 16
    inputs = random_tokens(rng, 1, h, p, g, n)
    params = random_params(rng, h, "model")
    state = rng.normal(size=(h, p, n)).astype(np.float32)
    x, dt, b, c = inputs
    a, d, dt_bias = params
    hf_state = torch.from_numpy(state.copy())[None]
    expand = lambda v: torch.from_numpy(v)[:, None].expand(-1, p)
    with torch.no_grad():
        y_hf = hf.mamba2_selective_state_update(
            hf_state, torch.from_numpy(x), expand(dt[0])[None], expand(a)[..., None].expand(-1, -1, n),
            torch.from_numpy(b), torch.from_numpy(c), expand(d), dt_bias=expand(dt_bias), dt_softplus=True,
        )  # fmt: skip
    for impl, options in (
        ("reference", {}),
        ("chunked", {}),
        ("pallas_tpu", dict(interpret=True, chunk_size=8)),
        ("pallas_gpu", dict(interpret=gpu_kernel_interpret(), chunk_size=16)),
    ):
        y, s = run_single(inputs, params, state, impl=impl, **options)
        np.testing.assert_allclose(y[0], y_hf[0].numpy(), err_msg=impl, **TOL)
        np.testing.assert_allclose(s, hf_state[0].numpy(), err_msg=impl, **TOL)


def test_op_composes_into_hf_mixer():
    """A tiny NemotronHMamba2Mixer (HF's own forward, no cache) == its in_proj and conv in torch,
    then our op with A = -exp(A_log) and dt_limit = the mixer's `time_step_limit` ((time_step_min,
    inf) up to transformers 5.24, the config's `time_step_limit` from 5.25), then its gated norm and
    out_proj: the op's contract is the layer's."""
    torch = pytest.importorskip("torch")
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    torch.manual_seed(0)
    config = NemotronHConfig(
        hidden_size=32, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
        num_hidden_layers=1, layers_block_type=["mamba"], time_step_min=0.3, use_conv_bias=True,
    )  # fmt: skip
    mixer = hf.NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(0.3 * torch.randn_like(param))
        hidden = torch.randn(1, 13, 32)
        want = mixer(hidden)[0].numpy()
        heads, head_dim, groups, n = 4, 16, 2, 16
        inner = heads * head_dim
        gate, xbc, dt = mixer.in_proj(hidden).split([inner, mixer.conv_dim, heads], dim=-1)
        xbc = torch.nn.functional.silu(mixer.conv1d(xbc.transpose(1, 2))[..., :13].transpose(1, 2))[0]
        x, b, c = xbc.split([inner, groups * n, groups * n], dim=-1)
        a = -torch.exp(mixer.A_log)
        arrays = [v.numpy() for v in (x.reshape(13, heads, head_dim), dt[0], b.reshape(13, groups, n))]
        arrays += [c.reshape(13, groups, n).numpy()]
        params = [a.numpy(), mixer.D.numpy(), mixer.dt_bias.numpy()]
        for impl in ("reference", "chunked"):
            y, _ = run_single(arrays, params, np.zeros((heads, head_dim, n), np.float32), impl=impl,
                              dt_limit=tuple(mixer.time_step_limit))  # fmt: skip
            got = mixer.out_proj(mixer.norm(torch.from_numpy(y.reshape(1, 13, inner).copy()), gate))[0].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=impl)


def make_ragged_batch(rng, lengths, num_seq_slots, num_tokens, num_slots, h, p, g, n, regime="model"):
    """A padded ragged batch; padding tokens are NaN and the null slot 0 holds NaN."""
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    assert cu[-1] <= num_tokens
    tokens = random_tokens(rng, num_tokens, h, p, g, n)
    for v in tokens:
        v[cu[-1] :] = np.nan
    params = random_params(rng, h, regime)
    slots = np.zeros(num_seq_slots, np.int32)
    slots[: len(lengths)] = rng.choice(np.arange(1, num_slots), size=len(lengths), replace=False)
    has_init = np.zeros(num_seq_slots, bool)
    has_init[: len(lengths)] = np.arange(len(lengths)) % 2 == 0  # with and without initial state
    pool = rng.normal(size=(num_slots, h, p, n)).astype(np.float32)
    pool[0] = np.nan
    return tokens, params, pool, cu, slots, has_init


def run_ragged(batch, lengths, **kwargs):
    (x, dt, b, c), (a, d, dt_bias), pool, cu, slots, has_init = batch
    meta = (jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(has_init), jnp.int32(len(lengths)))
    return ssd(x, dt, a, b, c, d, dt_bias, jnp.asarray(pool), *meta, **kwargs)


def assert_ragged_result(y, new_pool, batch, lengths):
    """Every real sequence matches the float64 oracle; no other real slot changed; padding
    outputs are zero."""
    (x, dt, b, c), (a, d, dt_bias), pool, cu, slots, has_init = batch
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    for s, length in enumerate(lengths):
        if length == 0:
            continue
        rows = slice(cu[s], cu[s] + length)
        init = pool[slots[s]] if has_init[s] else np.zeros_like(pool[slots[s]])
        y_ref, state_ref = numpy_ssd_oracle(x[rows], dt[rows], a, b[rows], c[rows], d, dt_bias, init)
        np.testing.assert_allclose(y[rows], y_ref, err_msg=f"sequence {s}", **TOL)
        np.testing.assert_allclose(new_pool[slots[s]], state_ref, err_msg=f"slot of {s}", **TOL)
    written = {slots[s] for s, length in enumerate(lengths) if length}
    for slot in range(1, pool.shape[0]):
        if slot not in written:
            np.testing.assert_array_equal(new_pool[slot], pool[slot], err_msg=f"slot {slot}")
    np.testing.assert_array_equal(y[cu[-1] :], 0.0)


# A prompt with a ragged last chunk, decode rows, an empty row, a chunk-aligned prompt.
RAGGED_LENGTHS = [19, 1, 0, 16, 5, 1]


@pytest.mark.parametrize("regime", ["model", "strong", "weak"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_ragged_jnp_impls_match_oracle(impl, regime):
    rng = np.random.default_rng(len(regime))
    batch = make_ragged_batch(rng, RAGGED_LENGTHS, 8, 48, 10, 4, 8, 2, 8, regime)
    y, new_pool = run_ragged(batch, RAGGED_LENGTHS, impl=impl, chunk_size=8)
    assert_ragged_result(y, new_pool, batch, RAGGED_LENGTHS)


@pytest.mark.parametrize(
    "interpret,regime,groups",
    [("plain", "model", 2), ("plain", "strong", 1), ("plain", "weak", 4), ("tpu_simulator", "model", 2)],
)
def test_tpu_kernel_matches_oracle_interpret(interpret, regime, groups):
    """Chunks of 8: full windows (19 = 2 x 8 + 3, 16) and masked partial windows."""
    rng = np.random.default_rng(5)
    batch = make_ragged_batch(rng, RAGGED_LENGTHS, 8, 48, 10, 4, 8, groups, 16, regime)
    mode = True if interpret == "plain" else pltpu.InterpretParams()
    try:
        y, new_pool = jax.block_until_ready(
            run_ragged(batch, RAGGED_LENGTHS, impl="pallas_tpu", interpret=mode, chunk_size=8)
        )
    finally:
        if interpret != "plain":
            pltpu.reset_tpu_interpret_mode_state()
    assert_ragged_result(y, new_pool, batch, RAGGED_LENGTHS)


def test_tpu_kernel_pads_batches_shorter_than_a_window():
    rng = np.random.default_rng(6)
    lengths = [3, 1]
    batch = make_ragged_batch(rng, lengths, 2, 6, 4, 2, 8, 1, 8, "strong")
    y, new_pool = run_ragged(batch, lengths, impl="pallas_tpu", interpret=True, chunk_size=8)
    assert y.shape == (6, 2, 8)
    assert_ragged_result(y, new_pool, batch, lengths)


@pytest.mark.parametrize("regime", ["model", "strong", "weak"])
def test_gpu_kernel_matches_oracle_interpret(regime):
    """Chunks of 16: full chunks (37 = 2 x 16 + 5, 16) and the per-token remainder; two
    head_dim blocks per head."""
    rng = np.random.default_rng(8)
    lengths = [37, 1, 0, 16, 3]
    batch = make_ragged_batch(rng, lengths, 6, 64, 10, 2, 32, 1, 16, regime)
    (x, dt, b, c), (a, d, dt_bias), pool, cu, slots, has_init = batch
    from pallas_kernels.ssd_kernel_gpu import ssd_gpu

    y, new_pool = ssd_gpu(
        x, ssd_dt(dt, dt_bias), a, b, c, d, jnp.asarray(pool), jnp.asarray(cu), jnp.asarray(slots),
        jnp.asarray(has_init.astype(np.int32)), jnp.int32([len(lengths)]),
        interpret=gpu_kernel_interpret(), chunk_size=16, block_p=16,
    )  # fmt: skip
    assert_ragged_result(y, new_pool, batch, lengths)


def test_bf16_inputs_keep_an_f32_state():
    rng = np.random.default_rng(9)
    lengths = [11, 1, 4]
    (x, dt, b, c), params, pool, cu, slots, has_init = make_ragged_batch(rng, lengths, 4, 24, 6, 2, 8, 1, 16)
    bf16 = [jnp.asarray(v, jnp.bfloat16) for v in (x, b, c)]
    meta = (jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(has_init), jnp.int32(len(lengths)))
    rounded = [np.asarray(v.astype(jnp.float32)) for v in bf16]
    for impl, options in (("chunked", dict(chunk_size=8)), ("pallas_tpu", dict(interpret=True, chunk_size=8))):
        y, new_pool = ssd(
            bf16[0], dt, params[0], *bf16[1:], *params[1:], jnp.asarray(pool), *meta, impl=impl, **options
        )
        assert y.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
        for s, length in enumerate(lengths):
            rows = slice(cu[s], cu[s] + length)
            init = pool[slots[s]] if has_init[s] else np.zeros_like(pool[slots[s]])
            args = (rounded[0][rows], dt[rows], params[0], rounded[1][rows], rounded[2][rows], *params[1:], init)
            y_ref, state_ref = numpy_ssd_oracle(*args)
            np.testing.assert_allclose(np.float32(y[rows]), y_ref, rtol=1e-2, atol=2e-2, err_msg=impl)
            np.testing.assert_allclose(new_pool[slots[s]], state_ref, rtol=1e-4, atol=1e-4, err_msg=impl)


def test_decode_step_equals_one_more_token_of_prefill():
    """Prefill of T+1 tokens == prefill of T, then `ssd_recurrent_step` and a one-token row of
    every impl from the carried state."""
    rng = np.random.default_rng(12)
    h, p, g, n, t = 4, 8, 2, 16, 12
    inputs = random_tokens(rng, t + 1, h, p, g, n)
    params = random_params(rng, h, "model")
    state0 = rng.normal(size=(h, p, n)).astype(np.float32)
    y_full, s_full = numpy_ssd_oracle(*inputs[:2], params[0], *inputs[2:], *params[1:], state0)
    _, s_prefix = run_single([v[:t] for v in inputs], params, state0, impl="chunked", chunk_size=8)
    x, dt, b, c = (v[t] for v in inputs)
    a, d, dt_bias = params
    expand = lambda v: np.repeat(v, h // g, axis=0)
    s_step, y_step = ssd_recurrent_step(s_prefix, x, ssd_dt(dt, dt_bias), a, expand(b), expand(c), d)
    np.testing.assert_allclose(y_step, y_full[t], **TOL)
    np.testing.assert_allclose(s_step, s_full, **TOL)
    for impl, options in (("reference", {}), ("chunked", {}), ("pallas_tpu", dict(interpret=True, chunk_size=8))):
        y, s = run_single([v[t : t + 1] for v in inputs], params, s_prefix, impl=impl, **options)
        np.testing.assert_allclose(y[0], y_full[t], err_msg=impl, **TOL)
        np.testing.assert_allclose(s, s_full, err_msg=impl, **TOL)


@pytest.mark.parametrize("impl", ["chunked", "pallas_tpu", "pallas_gpu"])
def test_split_prefill_equals_one_call(impl):
    rng = np.random.default_rng(11)
    h, p, g, n, length, split, bucket = 4, 16, 2, 16, 40, 27, 48
    inputs = random_tokens(rng, length, h, p, g, n)
    a, d, dt_bias = random_params(rng, h, "model")
    pool = jnp.zeros((2, h, p, n), jnp.float32)
    options = {
        "chunked": dict(chunk_size=8),
        "pallas_tpu": dict(interpret=True, chunk_size=8),
        "pallas_gpu": dict(interpret=gpu_kernel_interpret(), chunk_size=16),
    }[impl]

    def call(xs, pool, continues):  # every call padded to the same token bucket: one compile
        used = len(xs[0])
        x, dt, b, c = (np.concatenate([v, np.full((bucket - used,) + v.shape[1:], np.nan, v.dtype)]) for v in xs)
        meta = (jnp.int32([0, used]), jnp.int32([1]), jnp.bool_([continues]), jnp.int32([1]))
        y, pool = ssd(x, dt, a, b, c, d, dt_bias, pool, *meta, impl=impl, **options)
        return y[:used], pool

    y_full, pool_full = call(inputs, pool, False)
    y_a, pool_a = call([v[:split] for v in inputs], pool, False)
    y_b, pool_b = call([v[split:] for v in inputs], pool_a, True)
    np.testing.assert_allclose(jnp.concatenate([y_a, y_b]), y_full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pool_b[1], pool_full[1], rtol=1e-5, atol=1e-5)
    y_ref, s_ref = numpy_ssd_oracle(*inputs[:2], a, *inputs[2:], d, dt_bias, np.zeros((h, p, n)))
    np.testing.assert_allclose(y_full, y_ref, **TOL)
    np.testing.assert_allclose(pool_full[1], s_ref, **TOL)


def test_auto_and_bad_arguments():
    assert resolve(ssd_module.KERNELS, "auto", "cpu") == "reference"
    assert resolve(ssd_module.KERNELS, "auto", "cpu", interpret=True) == "pallas"
    assert resolve(ssd_module.KERNELS, "auto", "tpu") == resolve(ssd_module.KERNELS, "auto", "gpu") == "pallas"
    z = lambda *shape: jnp.zeros(shape, jnp.float32)
    meta = (jnp.int32([0, 4]), jnp.int32([1]), jnp.bool_([False]), jnp.int32(1))
    good = (z(4, 4, 8), z(4, 4), z(4), z(4, 2, 8), z(4, 2, 8), z(4), z(4), z(2, 4, 8, 8))
    with pytest.raises(ValueError, match="unknown impl 'nope'"):
        ssd(*good, *meta, impl="nope")
    with pytest.raises(ValueError, match="multiple of groups"):
        ssd(*good[:3], z(4, 3, 8), z(4, 3, 8), *good[5:], *meta)
    with pytest.raises(ValueError, match="must both be"):
        ssd(*good[:4], z(4, 2, 4), *good[5:], *meta)
    with pytest.raises(ValueError, match="does not match"):
        ssd(*good[:7], z(2, 4, 8, 4), *meta)


def abstract_args(t=256, h=8, p=64, g=2, n=128, s=8, slots=16, sharding=None):
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    f32 = jnp.float32
    return (
        sd((t, h, p), jnp.bfloat16),
        sd((t, h), f32),
        sd((h,), f32),
        sd((t, g, n), jnp.bfloat16),
        sd((t, g, n), jnp.bfloat16),
        sd((h,), f32),
        sd((h,), f32),
        sd((slots, h, p, n), f32),
        sd((s + 1,), jnp.int32),
        sd((s,), jnp.int32),
        sd((s,), jnp.bool_),
        sd((), jnp.int32),
    )


def test_tpu_kernel_lowers_for_tpu():
    fn = lambda *args: ssd(*args, impl="pallas_tpu")
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*abstract_args())
    assert "tpu_custom_call" in exported.mlir_module()


def test_gpu_kernel_lowers_for_cuda():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    fn = lambda *args: ssd(*args, impl="pallas_gpu")
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*abstract_args()).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_tpu_kernel_compiles_with_mosaic(chip):
    """libtpu's real Mosaic compiler, ahead of time on CPU (as tests/test_kernels_tpu_aot.py):
    interpret mode ignores TPU tiling rules. Nemotron-H's P = 64, N = 128, chunk 64, bf16 x/B/C."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        topology = topologies.get_topology_desc(f"{chip}=1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    except Exception as error:  # no libtpu in this environment
        pytest.skip(f"no TPU topology (libtpu) here: {error}")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    fn = lambda *args: ssd(*args, impl="pallas_tpu", chunk_size=64)
    compiled = jax.jit(fn).trace(*abstract_args(t=200, slots=9, sharding=sharding)).lower().compile()
    y, state = compiled.out_info
    assert y.shape == (200, 8, 64) and state.shape == (9, 8, 64, 128)
