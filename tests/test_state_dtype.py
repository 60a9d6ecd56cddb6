"""`cache.state_dtype`: GDN state slots stored in bfloat16, the recurrence computed in float32.

Every GDN path reads a bf16 slot, runs the float32 recurrence and rounds only what it stores back:
checked against test_gdn's float64 oracle started from the same (bf16) state. The engine with bf16
state runs the tiny hybrids and agrees with HF greedy; the schema, the engine config and the CLI
refuse other values; P/D carries the dtype on the wire; the plan counts the smaller slots.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from engine_testing import small_engine_config
from hf_reference import assert_greedy_match, hf_greedy, random_prompt
from kernel_testing import gpu_kernel_interpret
from test_gdn import TOL, make_ragged_batch, numpy_gdn_oracle

from configs.schema import ConfigError, config_from_dict
from pallas_kernels.causal_conv1d import causal_conv1d
from pallas_kernels.gdn import gated_delta_rule
from runtime.engine_config import EngineConfig, build_engine_config

BF16 = ml_dtypes.bfloat16
LENGTHS = [19, 1, 0, 16, 5, 1]  # full chunks + remainder, decode rows, an empty row


def _bf16_batch(seed: int, num_tokens: int):
    rng = np.random.default_rng(seed)
    inputs, pool, cu, slots, has_init = make_ragged_batch(rng, LENGTHS, 8, num_tokens, 10, 1, 2, 16, 32)
    return inputs, pool.astype(BF16), cu, slots, has_init


@pytest.mark.parametrize(
    "impl,options",
    [
        ("reference", {}),
        ("reference_chunked", {"chunk_size": 8}),
        ("chunked", {}),  # a 160-token bucket: WY chunks for the prompts, one batched step for decode rows
        ("native", {}),  # the C++ recurrence keeps f32 slots: a bf16 pool takes "chunked"
        ("pallas_tpu", {"interpret": True, "chunk_size": 8}),  # the state staged through a bf16 VMEM buffer
        ("pallas_gpu", {"interpret": gpu_kernel_interpret(), "chunk_size": 16}),
    ],
)
def test_bf16_slots_read_and_rounded_once_per_step(impl, options):
    """Outputs equal the float64 oracle from the bf16 initial state at float32 tolerance (the
    state is carried in f32 inside the step, chunk to chunk); each written slot is the oracle's
    final state rounded to bf16; every other slot is untouched, bit for bit."""
    num_tokens = 160 if impl == "chunked" else 48
    inputs, pool, cu, slots, has_init = _bf16_batch(3, num_tokens)
    o, new_pool = gated_delta_rule(
        *(jnp.asarray(x) for x in inputs),
        jnp.asarray(pool),
        jnp.asarray(cu),
        jnp.asarray(slots),
        jnp.asarray(has_init),
        jnp.int32(len(LENGTHS)),
        impl=impl,
        **options,
    )
    assert new_pool.dtype == jnp.bfloat16
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    written = set()
    for s, length in enumerate(LENGTHS):
        if not length:
            continue
        rows = slice(cu[s], cu[s] + length)
        init = pool[slots[s]].astype(np.float64) if has_init[s] else np.zeros(pool.shape[1:])
        o_ref, state_ref = numpy_gdn_oracle(*(x[rows] for x in inputs), init)
        np.testing.assert_allclose(o[rows], o_ref, err_msg=f"sequence {s}", **TOL)
        # f32 math, then one rounding to bf16 (half an ulp: 2^-9 relative)
        np.testing.assert_allclose(new_pool[slots[s]].astype(np.float64), state_ref, rtol=2**-8, atol=2e-5)
        written.add(slots[s])
    for slot in set(range(1, pool.shape[0])) - written:
        np.testing.assert_array_equal(new_pool[slot].view(np.uint16), pool[slot].view(np.uint16))


def test_bf16_conv_state_window():
    """The conv window follows the flag: a bf16 slot seeds the window exactly (read as stored) and
    receives the sequence's last W-1 raw inputs rounded to bf16. float64 numpy oracle."""
    rng = np.random.default_rng(4)
    T, C, W = 5, 24, 4
    x = rng.normal(size=(T, C)).astype(np.float32)
    weight = rng.normal(size=(C, W)).astype(np.float32)
    state = rng.normal(size=(3, W - 1, C)).astype(BF16)
    y, new_state = causal_conv1d(
        jnp.asarray(x),
        jnp.asarray(weight),
        jnp.asarray(state),
        jnp.int32([0, T]),
        jnp.int32([2]),
        jnp.bool_([True]),
        jnp.int32(1),
    )
    history = np.concatenate([state[2].astype(np.float64), x.astype(np.float64)])  # [W-1+T, C]
    pre = np.stack([sum(history[t + j] * weight[:, j] for j in range(W)) for t in range(T)])
    np.testing.assert_allclose(np.asarray(y), pre / (1 + np.exp(-pre)), rtol=2e-5, atol=2e-5)
    assert new_state.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(new_state[2]).view(np.uint16), x[-(W - 1) :].astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(new_state[1]).view(np.uint16), state[1].view(np.uint16))


def test_config_layers_accept_the_two_dtypes_and_refuse_others():
    assert config_from_dict({}).cache.state_dtype == "float32"
    launch = config_from_dict({"cache": {"state_dtype": "bfloat16"}})
    assert build_engine_config(launch, "m").state_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"cache.state_dtype: must be one of 'float32', 'bfloat16', got 'float16'"):
        config_from_dict({"cache": {"state_dtype": "float16"}})
    with pytest.raises(ValueError, match=r"state_dtype: must be one of 'float32', 'bfloat16', got 'fp8_e4m3'"):
        EngineConfig(model="m", state_dtype="fp8_e4m3")


def test_cli_flag_sets_the_state_dtype():
    from server.cli import _load, _parser

    assert _load(_parser().parse_args(["config", "--state-dtype", "bfloat16"])).cache.state_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        _parser().parse_args(["config", "--state-dtype", "float16"])


def _slot_bytes_from_config_json(config_json, itemsize: int) -> int:
    """One state slot's bytes, from the checkpoint's config.json (not our parser)."""
    import json

    hf = json.loads(config_json.read_text())
    hf = hf.get("text_config", hf)
    kh, vh = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    n = hf["num_hidden_layers"]  # Qwen3-Next: every full_attention_interval-th layer is attention
    types = hf.get("layer_types") or [
        ("linear", "full")[(i + 1) % hf["full_attention_interval"] == 0] for i in range(n)
    ]
    layers = sum(t.startswith("linear") for t in types)
    conv = (hf["linear_conv_kernel_dim"] - 1) * (2 * kh * dk + vh * dv)
    return itemsize * layers * (conv + vh * dk * dv)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_engine_with_bf16_state_agrees_with_hf(family, tiny_checkpoint, hf_model):
    from engine_testing import drain

    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint(family)
    engine = LLMEngine(small_engine_config(path, state_dtype="bfloat16"))
    states = [a for a in (*engine.caches["conv"], *engine.caches["rec"]) if a is not None]
    assert states and all(a.dtype == jnp.bfloat16 for a in states)
    assert engine.model.state_bytes_per_slot() == _slot_bytes_from_config_json(path / "config.json", 2)
    prompt = random_prompt(engine.model.cfg.vocab_size, 13, seed=7)
    engine.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    got = drain(engine)["r"].token_ids
    expected, scores = hf_greedy(hf_model(family), prompt, 8)
    assert_greedy_match(got, expected, scores, f"{family} with bf16 state")


def test_pd_wire_carries_the_state_dtype(tiny_checkpoint):
    """A bf16-state prefill side sends its slot as raw bf16 bits named by `state_dtype`; a float32
    or bf16 decode side takes it (bit-exact: bf16 -> f32 is exact); a descriptor naming another
    state dtype, or arrays that disagree with the one it names, is refused before any pull."""
    from models.model import load_model
    from models.ops import KernelOptions
    from runtime.kv_transfer.base import TransferError
    from runtime.kv_transfer.descriptor import check_descriptor
    from runtime.kv_transfer.layout import expected_arrays, gather_request_state, write_request_state

    model = load_model(tiny_checkpoint("qwen3_5"))
    rng = np.random.default_rng(0)

    def caches(state_dtype, fill=False):
        model.state_dtype = state_dtype
        c = model.init_caches(8, 16, 4)
        if fill:
            c["conv"] = tuple(None if a is None else jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in c["conv"])
            c["rec"] = tuple(None if a is None else jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in c["rec"])
        return c

    sent_caches = caches("bfloat16", fill=True)
    prompt = list(range(3, 30))
    kw = dict(state_slot=2, page_size=16, num_pages=8, num_slots=4)
    arrays, desc = gather_request_state(
        sent_caches, model.cfg, prompt_token_ids=prompt, num_tokens=26, block_table=[3, 5], **kw
    )
    assert desc["state_dtype"] == "bfloat16"
    assert {dt for name, _, dt in desc["arrays"] if name.startswith(("conv", "rec"))} == {"uint16"}
    assert check_descriptor(desc, prompt_token_ids=prompt, signature=desc["model"]) == 26
    assert expected_arrays(desc, model.cfg) == desc["arrays"]
    for decode_dtype in ("float32", "bfloat16"):
        got = write_request_state(
            caches(decode_dtype), list(arrays), desc, block_table=[1, 6], opts=KernelOptions(), **kw
        )
        for name in ("conv", "rec"):
            for sent, new in zip(sent_caches[name], got[name]):
                if sent is None:
                    continue
                G = sent.shape[0] // 4
                assert new.dtype == jnp.dtype(decode_dtype)
                rows = np.arange(G) * 4 + 2
                np.testing.assert_array_equal(np.asarray(new[rows], np.float32), np.asarray(sent[rows], np.float32))
    with pytest.raises(TransferError, match="state_dtype 'float16' is not one of"):
        check_descriptor({**desc, "state_dtype": "float16"}, prompt_token_ids=prompt, signature=desc["model"])
    with pytest.raises(TransferError, match="differ from what this model expects"):
        expected_arrays({**desc, "state_dtype": "float32"}, model.cfg)


@pytest.mark.parametrize("config", ["tpu-v5e-8-qwen3_5-27b.yaml", "tpu-v5p-16-qwen3-next-80b-multihost.yaml"])
def test_plan_counts_bf16_state_slots(config):
    """`jaxserve plan` (no compile): a slot per device is half the float32 one, by the config.json
    formula; the pool and checkpoints are sized from it."""
    from configs.schema import CONFIG_DIR, load_config
    from runtime.aot.chip_report import model_config_json, plan_config
    from runtime.aot.plan_report import report_json

    reports = {}
    for dtype in ("float32", "bfloat16"):
        launch = load_config(CONFIG_DIR / config, {"cache.state_dtype": dtype})
        reports[dtype] = plan_config(launch, config, token_buckets=(), compile_sampler=False)
    f32, bf16 = reports["float32"], reports["bfloat16"]
    slot = _slot_bytes_from_config_json(model_config_json(launch), 2) // launch.parallel.mesh.model  # GDN heads split
    assert bf16.state_bytes_per_slot == slot == f32.state_bytes_per_slot // 2
    assert report_json(bf16)["state_bytes_per_slot"] == slot
    assert bf16.fits and bf16.num_pages >= f32.num_pages
