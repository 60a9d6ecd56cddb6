"""Nemotron-H (`NemotronHForCausalLM`, Mamba-2 hybrid) against HF transformers' own model on the tiny fp32 checkpoint.

Ten single-mixer blocks "M-M*-M-M*-" (models/random_nemotron_h.py): Mamba-2 mixers with 6 heads in
2 B/C groups, conv bias, gated group RMSNorm; attention without RoPE (GQA 2, head_dim != hidden /
heads); relu2 MLP blocks without a gate. HF runs its torch Mamba-2 path (mamba_ssm is not
installed) with eager attention. Checked: logits within 1e-4 through the paged forward (layer scan
and unrolled; the SSD op's per-token loop, its chunked jnp form, the TPU Pallas kernel interpreted;
on a second checkpoint with Triton-sized SSM heads and a pattern that never repeats, "M-M*-M", the
GPU kernel interpreted too), a dt clamp (`time_step_limit`) that bites, greedy decoding through the paged caches,
and one engine (16-token steps, pages of 8, a small pool, prefix caching) whose greedy output is
HF's under chunked prefill, prefix-cache hits (state checkpoints) and preemptions, with every page
and state slot back afterwards; the abstract parameter tree, the shipped Nemotron-H-8B config's
size, and what we refuse with a message (MoE blocks: tests/test_nemotron_h_moe.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_bf16_as_close_as_hf_bf16, assert_greedy_match, hf_greedy, hf_logits, random_prompt
from kernel_testing import gpu_kernel_interpret

from configs import CONFIG_DIR
from models import load_model
from models.config import ConfigError, parse_config
from models.mamba2_config import MAMBA, NO_MIXER, NO_MLP
from models.model import Model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from models.weights import abstract_params

FAMILY = "nemotron_h"
LENGTHS = (1, 7, 8, 23, 70, 150)  # HF's chunk 8: one token, one chunk, many chunks, many pages


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    """HF's NemotronHForCausalLM in float32 with eager attention."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = tiny_checkpoint(FAMILY)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


def test_config_parses_the_pattern_and_the_mixer(ours, hf):
    cfg, hc = ours.cfg, hf.config
    m = cfg.mamba
    assert cfg.architecture == "NemotronHForCausalLM" and cfg.num_layers == 10 and cfg.layer_period() == 5
    assert cfg.layer_types == (MAMBA, NO_MIXER, MAMBA, "full_attention", NO_MIXER) * 2
    assert cfg.mlp_types == (NO_MLP, "dense", NO_MLP, NO_MLP, "dense") * 2
    assert cfg.rotary_dim == 0 and not cfg.attention_bias and cfg.hidden_act == "relu2" and cfg.is_hybrid
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups) == (
        hc.mamba_num_heads,
        hc.mamba_head_dim,
        hc.ssm_state_size,
        hc.n_groups,
    )
    assert (m.conv_kernel, m.conv_bias, m.proj_bias) == (hc.conv_kernel, hc.use_conv_bias, hc.use_bias)
    assert cfg.rms_norm_eps == m.norm_eps == hc.layer_norm_epsilon and cfg.num_linear_layers == 4


@pytest.mark.parametrize("ssd_impl,unrolled", [("auto", False), ("auto", True), ("chunked", False)])
def test_logits_match_hf(ours, hf, ssd_impl, unrolled):
    """The per-token SSD loop ("auto" on CPU) over every length; its chunked jnp form (chunks of 16
    never spanning two sequences) over a ragged and a many-chunk prompt."""
    model = load_model(ours.path, dtype="float32") if unrolled else ours
    if unrolled:
        model.unstack_layers()
    opts = KernelOptions(gdn=ssd_impl)  # the SSD op follows the GDN back-end's name (models/mamba2.py)
    for n in LENGTHS if ssd_impl == "auto" else (23, 150):
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        expected = hf_logits(hf, ids)
        got = model.logits(ids, opts)
        assert got.shape == expected.shape
        err = np.abs(got - expected).max()
        assert err <= 1e-4, f"ssd={ssd_impl} unrolled={unrolled} T={n}: max abs logit error {err:.2e}"


def test_logits_match_hf_through_the_tpu_ssd_kernel_interpreted(ours, hf):
    for n in (70,):
        ids = random_prompt(ours.cfg.vocab_size, n, seed=n)
        got = ours.logits(ids, KernelOptions(attention="reference", gdn="pallas_tpu", interpret=True))
        err = np.abs(got - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"pallas_tpu T={n}: max abs logit error {err:.2e}"


GPU_SHAPED = dict(hybrid_override_pattern="M-M*-M", mamba_head_dim=16, ssm_state_size=16)


@pytest.fixture(scope="module")
def gpu_shaped(tmp_path_factory):
    """A second tiny checkpoint whose SSM head_dim and state size are what the Triton kernel takes
    (powers of two >= 16) and whose pattern "M-M*-M" repeats nowhere (one layer group)."""
    from transformers import AutoModelForCausalLM

    from models.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(FAMILY, tmp_path_factory.mktemp("nemotron_h_gpu_shaped"), seed=1, **GPU_SHAPED)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return load_model(path, dtype="float32"), hf


@pytest.mark.parametrize("gdn", ["auto", "pallas_tpu", "pallas_gpu"])
def test_one_group_pattern_matches_hf_through_every_ssd_kernel(gpu_shaped, gdn):
    model, hf = gpu_shaped
    assert model.cfg.layer_period() == model.cfg.num_layers == 6
    interpret = gpu_kernel_interpret() if gdn == "pallas_gpu" else gdn != "auto"  # compiled on a GPU
    opts = KernelOptions(attention="reference", gdn=gdn, interpret=interpret)
    for n in (1, 70):  # a decode-sized row; many chunks with a ragged last one
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        err = np.abs(model.logits(ids, opts) - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"gdn={gdn} T={n}: max abs logit error {err:.2e}"


def test_a_dt_clamp_that_bites_matches_hf(ours, hf):
    """`time_step_limit` (0.15, inf) clamps most of these weights' dt (softplus(dt + dt_bias) is
    ~0.13 at the median): set on HF's mixers (their own attribute, as transformers 5.24 and 5.25
    both read it in the prefill scan) and in our config, the logits still agree, and they are far
    from the unclamped ones."""
    limit = (0.15, float("inf"))
    ids = random_prompt(ours.cfg.vocab_size, 70, seed=71)
    unclamped = hf_logits(hf, ids)
    mixers = [layer.mixer for layer in hf.model.layers if hasattr(layer.mixer, "time_step_limit")]
    assert len(mixers) == 4
    saved = [mixer.time_step_limit for mixer in mixers]
    try:
        for mixer in mixers:
            mixer.time_step_limit = limit
        expected = hf_logits(hf, ids)
    finally:
        for mixer, value in zip(mixers, saved):
            mixer.time_step_limit = value
    cfg = dataclasses.replace(ours.cfg, mamba=dataclasses.replace(ours.cfg.mamba, dt_limit=limit))
    got = Model(cfg, ours.params, "float32", ours.path).logits(ids)
    assert np.abs(expected - unclamped).max() > 1e-2
    assert np.abs(got - expected).max() <= 1e-4


def test_each_feature_moves_the_logits_beyond_the_tolerance(ours, hf):
    """Leaving out a Nemotron-H feature would fail `test_logits_match_hf` by orders of magnitude."""
    ids = random_prompt(ours.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf, ids)
    cfg = ours.cfg
    variants = {"RoPE on the attention blocks": dict(rotary_dim=cfg.head_dim), "silu MLP": dict(hidden_act="silu")}
    for what, change in variants.items():
        variant = Model(dataclasses.replace(cfg, **change), ours.params, "float32", ours.path)
        err = np.abs(variant.logits(ids) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


def test_greedy_matches_hf_generate(ours, hf):
    """Prefill, then one-token decode steps carrying the conv and SSM states in their slot (HF's
    decode path is its own: `causal_conv1d_update` and `mamba2_selective_state_update`)."""
    ids = random_prompt(ours.cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf, ids, 24)
    assert_greedy_match(ours.greedy(ids, 24), expected, scores, "nemotron_h prompt 30")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """The module's one engine: 16-token steps (chunked prefill), pages of 8 in a pool too small for
    every request at once (preemption), prefix caching with state checkpoints."""
    from runtime.engine.llm_engine import LLMEngine

    config = small_engine_config(
        tiny_checkpoint(FAMILY),
        page_size=8,
        num_pages=28,
        max_num_batched_tokens=16,
        max_model_len=160,
        enable_prefix_caching=True,
        load_tokenizer=False,
    )
    return LLMEngine(config)


def _assert_nothing_leaked(engine):
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats
    assert stats["slots_free"] + stats["slots_cached"] == stats["slots_total"], stats
    return stats


def _run(engine, prompts: dict, max_tokens: int) -> dict:
    from runtime.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    return drain(engine)


def test_engine_chunked_prefill_greedy_matches_hf(engine, hf):
    """16-token steps: every prompt but the first is prefilled in chunks (each chunk continuing from
    the conv and SSM states the last one left in the slot), with decodes riding along."""
    vocab = engine.model.cfg.vocab_size
    prompts = {f"c{i}": random_prompt(vocab, n, seed=500 + i) for i, n in enumerate((5, 41, 19, 66))}
    done = _run(engine, prompts, 10)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, 10)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")
    _assert_nothing_leaked(engine)


def test_engine_prefix_hits_and_preemption_match_hf(engine, hf):
    """A chat continuation resumes from its predecessor's state checkpoint and a shared 30-token
    prefix from a divergence checkpoint (the waves of tests/test_engine_prefix_caching.py); then four
    60-80-token requests generating 30 tokens each overflow the 28-page pool and preempt each other.
    Every output is HF's greedy one, and every page and state slot comes back."""
    rng = np.random.default_rng(17)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    preemptions = engine.stats()["num_preemptions"]
    prompt, prompts, done, lengths = draw(45), {}, {}, {}

    def wave(max_tokens: int, **new):
        prompts.update(new)
        lengths.update(dict.fromkeys(new, max_tokens))
        done.update(_run(engine, new, max_tokens))

    wave(10, r0=prompt)
    wave(10, r1=prompt + done["r0"].outputs[0].token_ids + draw(7), r2=prompt[:30] + draw(12))
    wave(10, r3=prompt[:30] + draw(9), r4=prompt)
    wave(30, p0=draw(60), p1=draw(70), p2=draw(50), p3=draw(80))
    cached = {rid: done[rid].num_cached_tokens for rid in ("r0", "r1", "r2", "r3", "r4")}
    assert cached["r1"] >= 48 and cached["r3"] >= 24 and cached["r4"] >= 24, cached
    assert done["r4"].outputs[0].token_ids == done["r0"].outputs[0].token_ids  # a hit == the miss, exactly
    stats = _assert_nothing_leaked(engine)
    assert stats["num_preemptions"] > preemptions, "the pool was meant to force preemptions"
    assert 0 < stats["slots_cached"] <= engine.cache_config.num_checkpoint_slots
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, lengths[rid])
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(tiny_checkpoint, hf, layout):
    """bf16 weights, as loaded and in the CPU plan's packed layout (`Model.hold_packed`, the engine's
    on a bf16 CPU): our logits are as close to HF's float32 ones as HF's own bfloat16 model's are (within
    2x). The SSM and conv states stay float32 in both."""
    assert_bf16_as_close_as_hf_bf16(tiny_checkpoint(FAMILY), hf, layout, attn_implementation="eager")


def test_published_backbone_layout_loads(ours, tiny_checkpoint, tmp_path):
    """NVIDIA's checkpoints keep the decoder under `backbone.` (transformers 5.x saves `model.`) and
    name the pattern `hybrid_override_pattern` with `num_hidden_layers`."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint(FAMILY)
    tensors = {k.replace("model.", "backbone.", 1): v for k, v in load_file(src / "model.safetensors").items()}
    assert any(k.startswith("backbone.embeddings.") for k in tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    hf_cfg = {k: v for k, v in read_json(src / "config.json").items() if k not in ("layers_block_type", "layer_types")}
    hf_cfg.update(hybrid_override_pattern="M-M*-M-M*-", num_hidden_layers=10)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    model = load_model(tmp_path, dtype="float32")
    assert model.cfg == dataclasses.replace(ours.cfg, eos_token_ids=model.cfg.eos_token_ids)
    ids = random_prompt(ours.cfg.vocab_size, 23, seed=23)
    np.testing.assert_array_equal(model.logits(ids), ours.logits(ids))


def test_shipped_nemotron_h_8b_config():
    """configs/models/nemotron-h-8b.json: 52 blocks (24 Mamba-2, 24 MLP, 4 attention, as the
    Nemotron-H paper lists), HF's own NemotronHConfig reads the same pattern, about 8B parameters
    (the model card's size)."""
    from transformers import NemotronHConfig

    published = read_json(CONFIG_DIR / "models" / "nemotron-h-8b.json")
    cfg = parse_config(published)
    text = NemotronHConfig(**{k: v for k, v in published.items() if not k.startswith("_")})
    assert len(text.layers_block_type) == cfg.num_layers == 52 and cfg.layer_period() == 52
    assert [t == MAMBA for t in cfg.layer_types] == [t == "linear_attention" for t in text.layers_block_type]
    assert (cfg.layer_types.count(MAMBA), cfg.mlp_types.count("dense"), cfg.num_attention_layers) == (24, 24, 4)
    assert cfg.mamba.conv_dim == 8192 + 2 * 8 * 128 and cfg.mamba.dt_limit == (0.0, float("inf"))
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 8.0e9 - 1) < 0.05, count


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(layers_block_type=None, hybrid_override_pattern="M-E*-", moe_latent_size=8), "moe_latent_size"),
        (dict(layers_block_type=["mamba", "cross_attention"]), "unknown block types"),
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act"),
        (dict(mlp_hidden_act="tanh"), "mlp_hidden_act"),
        (dict(n_groups=4), "multiple of n_groups"),
        (dict(time_step_limit=[0.5, 0.1]), "time_step_limit"),
    ],
)
def test_unsupported_options_are_refused_at_load(tiny_checkpoint, tmp_path, change, match):
    src = tiny_checkpoint(FAMILY)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    hf_cfg = read_json(tmp_path / "config.json")
    hf_cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path)


def test_tensor_parallel_plan_splits_mamba_heads_that_divide(ours):
    """6 SSM heads in 2 B/C groups: a model axis of 2 splits them (models/mamba2_tp.py; checked
    against HF in tests/test_nemotron_h_tp.py); 4 does not divide them: the Mamba-2 layers stay whole."""
    from jax.sharding import AbstractMesh, AxisType

    from models.sharding import tensor_parallel_plan

    plans = [
        tensor_parallel_plan(ours.cfg, AbstractMesh((1, m), ("data", "model"), axis_types=(AxisType.Auto,) * 2))
        for m in (2, 4)
    ]
    assert [p.mamba for p in plans] == [True, False] and not any(p.gdn for p in plans)


# Nemotron-H-8B's state slot from its published config, by hand: 24 Mamba-2 layers, each with a conv
# state of (conv_kernel - 1) x (heads x head_dim + 2 x groups x state) and an SSM state of
# heads x head_dim x state, fp32.
NEMOTRON_H_8B_SLOT_BYTES = 4 * 24 * (3 * (128 * 64 + 2 * 8 * 128) + 128 * 64 * 128)


def test_jaxserve_plan_sizes_nemotron_h_8b_on_an_h200():
    """`jaxserve plan` for the shipped H200 config pointed at Nemotron-H-8B (shapes only, up to the
    compile): bf16 weights of ~8B parameters, 4 attention layers' KV per token, a state slot of the
    24 Mamba-2 layers' conv and SSM states, and it fits."""
    from configs import load_config
    from runtime.aot.chip_report import plan_config

    name = "gpu-h200-qwen3_5-9b.yaml"
    launch = load_config(
        CONFIG_DIR / name,
        {"model.path": "/models/Nemotron-H-8B-Base-8K", "model.max_model_len": 8192, "server.reasoning_parser": None},
    )
    report = plan_config(launch, name, token_buckets=(), compile_sampler=False)
    assert report.fits, report.problems
    assert abs(report.param_count / 8.0e9 - 1) < 0.05
    assert 0 <= report.weight_bytes - 2 * report.param_count < 2**20  # bf16; A_log, dt_bias fp32
    assert report.kv_bytes_per_token == 2 * 4 * 8 * 128  # fp8 K and V of 8 KV heads x 128, 4 layers
    assert report.state_bytes_per_slot == NEMOTRON_H_8B_SLOT_BYTES
    assert report.num_state_slots > launch.scheduler.max_num_seqs


DP_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

def run(mesh_shape):
    engine = LLMEngine(EngineConfig(model=sys.argv[1], load_tokenizer=False, mesh_shape=mesh_shape, page_size=16,
                                    num_pages=32, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 16, 32),
                                    max_model_len=96, enable_prefix_caching=True, aot_compile=False))
    rng, done = np.random.default_rng(0), {}
    shared = rng.integers(3, 1000, 48).tolist()
    for i, n in enumerate([5, 40, 9, 23, 2, 17, 31]):
        prompt = rng.integers(3, 1000, n).tolist()
        if i % 2:  # shared 32- and 48-token prefixes: state checkpoints on every rank
            prompt = shared[: 32 + 16 * (i % 4 == 3)] + prompt[:8]
        params = SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    stats = engine.stats()
    return {"tokens": done, **{k: stats[k] for k in ("prefix_cache_hit_tokens", "pages_used", "slots_used")}}

print("REPORT " + json.dumps({"single": run(None), "dp": run((2, 1))}))
"""


@pytest.mark.slow
def test_data_parallel_engine_matches_single_device(tiny_checkpoint):
    """Attention DP over 2 simulated CPU devices (data 2, model 1; a subprocess: the device count
    must not leak): each rank's Mamba-2 states in its own slots, prefix hits on both, the same
    greedy tokens as the single-device engine (itself HF's above), nothing leaked."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", DP_SCRIPT, str(tiny_checkpoint(FAMILY))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    report = json.loads(line[len("REPORT ") :])
    single, dp = report["single"], report["dp"]
    assert len(single["tokens"]) == 7 and dp["tokens"] == single["tokens"]
    assert dp["prefix_cache_hit_tokens"] > 0 and dp["pages_used"] == dp["slots_used"] == 0, dp


def test_jaxserve_plan_splits_nemotron_h_8b_over_a_tpu_v5e_8():
    """The v5e-8 TP8 config pointed at Nemotron-H-8B (shapes only): 128 SSM heads and 8 B/C groups
    split 8 ways, so a state slot on one chip is an eighth of the whole."""
    from configs import load_config
    from runtime.aot.chip_report import plan_config

    name = "tpu-v5e-8-qwen3_5-27b.yaml"
    launch = load_config(
        CONFIG_DIR / name, {"model.path": "/models/Nemotron-H-8B-Base-8K", "model.max_model_len": 8192}
    )
    report = plan_config(launch, name, token_buckets=(), compile_sampler=False)
    assert report.fits, report.problems
    assert report.state_bytes_per_slot == NEMOTRON_H_8B_SLOT_BYTES // 8


def test_bfloat16_state_slots_refused_at_start_up(tiny_checkpoint):
    """cache.state_dtype bfloat16 is for GDN hybrids: a Mamba-2 model refuses it with a message."""
    from runtime.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="Mamba-2"):
        LLMEngine(small_engine_config(tiny_checkpoint(FAMILY), state_dtype="bfloat16"))
