"""gpt-oss (`GptOssForCausalLM`) against HF transformers' own model on the tiny fp32 checkpoint.

Window 7 over 4 layers alternating sliding / full attention, learned sinks, YaRN RoPE, biased
experts with the clamped SwiGLU (models/random_gpt_oss.py). Prompts run many windows long and
across pages of 16. Checked: logits within 1e-4 through the paged forward (layer scan and
unrolled layers; the CPU's native attention, the jnp paths, the TPU and GPU Pallas kernels
interpreted), greedy decoding through the paged caches, the engine's greedy output under chunked
prefill with decodes riding along, bf16 logits (as loaded and packed for the CPU) as close to
HF's fp32 ones as HF's own bf16 model, that each gpt-oss feature changes the logits far beyond
that tolerance (so the comparison would catch its omission), the abstract parameter tree, the
shipped gpt-oss-120b config. MXFP4 checkpoints: tests/test_gpt_oss_mxfp4.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_bf16_as_close_as_hf_bf16, assert_greedy_match, hf_greedy, hf_logits, random_prompt

from configs import CONFIG_DIR
from models import load_model
from models.config import parse_config
from models.model import Model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from models.weights import abstract_params

FAMILY = "gpt_oss"
LENGTHS = (1, 7, 8, 23, 70, 150)  # window 7: one window, just past it, many windows, many pages


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


def test_config_parses_windows_sinks_and_experts(ours, tiny_checkpoint):
    hf = read_json(tiny_checkpoint(FAMILY) / "config.json")
    cfg = ours.cfg
    assert cfg.architecture == "GptOssForCausalLM"
    assert cfg.sliding_windows == (7, 0, 7, 0) and hf["layer_types"][0] == "sliding_attention"
    assert cfg.layer_period() == 2 and cfg.attention_sinks and cfg.attention_bias and cfg.gpt_oss_moe
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 40)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (hf["swiglu_alpha"], hf["swiglu_limit"])
    assert cfg.rope_type == "yarn" and dict(cfg.rope_scaling)["truncate"] is False


@pytest.mark.parametrize(
    "attention,unrolled", [("auto", False), ("auto", True), ("reference", False), ("chunked", False)]
)
def test_logits_match_hf(ours, hf_model, attention, unrolled):
    model = load_model(ours.path, dtype="float32") if unrolled else ours
    if unrolled:
        model.unstack_layers()
    hf = hf_model(FAMILY)
    for n in LENGTHS:
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        expected = hf_logits(hf, ids)
        got = model.logits(ids, KernelOptions(attention=attention))
        assert got.shape == expected.shape
        err = np.abs(got - expected).max()
        assert err <= 1e-4, f"attention={attention} unrolled={unrolled} T={n}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
def test_logits_match_hf_through_the_pallas_kernels_interpreted(ours, hf_model, kernel, tmp_path):
    """The TPU and GPU attention kernels (interpret mode) with this model's windows and sinks. The
    GPU kernel needs a power-of-two head_dim (gpt-oss's is 64): a head_dim-16 copy of the family."""
    from transformers import AutoModelForCausalLM

    from models.random_checkpoint import write_random_checkpoint

    model, hf = ours, hf_model(FAMILY)
    if kernel == "pallas_gpu":
        path = write_random_checkpoint(FAMILY, tmp_path / "hd16", head_dim=16)
        model = load_model(path, dtype="float32")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for n in (23, 70):
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        got = model.logits(ids, KernelOptions(attention=kernel, interpret=True))
        err = np.abs(got - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"{kernel} T={n}: max abs logit error {err:.2e}"


def _variant_logits(model, ids, cfg=None, params=None) -> np.ndarray:
    """Our logits with a changed config or parameters (one feature turned off)."""
    return Model(cfg or model.cfg, params or model.params, "float32", model.path).logits(ids)


def test_each_feature_moves_the_logits_beyond_the_tolerance(ours, hf_model):
    """Window, sinks, the SwiGLU clamp and the router bias each matter on these prompts: leaving
    any of them out would fail `test_logits_match_hf` by orders of magnitude."""
    ids = random_prompt(ours.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf_model(FAMILY), ids)
    cfg, groups = ours.cfg, ours.params["groups"]

    def with_groups(update) -> dict:
        return {**ours.params, "groups": tuple({**g, **update(g)} for g in groups)}

    variants = {
        "no window": dict(cfg=dataclasses.replace(cfg, sliding_windows=(1000, 0, 1000, 0))),  # same layer groups
        "no clamp": dict(cfg=dataclasses.replace(cfg, swiglu_limit=1e9)),
        "no sinks": dict(params=with_groups(lambda g: {"sinks": jnp.full_like(g["sinks"], -1e30)})),
        "no router bias": dict(params=with_groups(lambda g: {"router_bias": jnp.zeros_like(g["router_bias"])})),
    }
    for what, change in variants.items():
        err = np.abs(_variant_logits(ours, ids, **change) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


def test_greedy_matches_hf_generate(ours, hf_model):
    ids = random_prompt(ours.cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf_model(FAMILY), ids, 24)  # decode runs past 7 windows
    assert_greedy_match(ours.greedy(ids, 24), expected, scores, "gpt_oss prompt 30")


@pytest.mark.parametrize("layer_loop", ["auto", "scan"])  # auto on CPU: layers unrolled
def test_engine_chunked_prefill_greedy_matches_hf(tiny_checkpoint, hf_model, layer_loop):
    """16-token steps: every prompt but the first is prefilled in chunks, with decodes riding along."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint(FAMILY)
    config = small_engine_config(path, max_num_batched_tokens=16, load_tokenizer=False, layer_loop=layer_loop)
    engine = LLMEngine(config)
    vocab = engine.model.cfg.vocab_size
    prompts = {f"r{i}": random_prompt(vocab, n, seed=500 + i) for i, n in enumerate((5, 41, 19, 66))}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    outputs = drain(engine)
    hf = hf_model(FAMILY)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, 10)
        assert_greedy_match(outputs[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(tiny_checkpoint, hf_model, layout):
    """bf16 weights, as loaded and in the CPU plan's packed layout (`Model.hold_packed`: the router
    too): our logits are as close to HF's float32 ones as HF's own bfloat16 model's are (within 2x)."""
    assert_bf16_as_close_as_hf_bf16(tiny_checkpoint(FAMILY), hf_model(FAMILY), layout)


def test_shipped_gpt_oss_120b_config():
    """configs/models/gpt-oss-120b.json: 36 layers alternating window 128 / full, 128 experts top-4,
    YaRN x32 from 4096; about 117B parameters (OpenAI's model card: 116.8B total)."""
    cfg = parse_config(read_json(CONFIG_DIR / "models" / "gpt-oss-120b.json"))
    assert cfg.sliding_windows == (128, 0) * 18 and cfg.layer_period() == 2
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_heads, cfg.num_kv_heads) == (128, 4, 64, 8)
    inv_freq, attention_factor = cfg.inv_freq()
    assert inv_freq.shape == (32,) and attention_factor == pytest.approx(0.1 * np.log(32) + 1)
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 116.8e9 - 1) < 0.02, count
