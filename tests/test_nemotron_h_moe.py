"""Nemotron-H MoE blocks (`E`, Nemotron 3 Nano) against HF transformers' NemotronHForCausalLM, fp32.

The tiny `nemotron_h_moe` checkpoint (models/random_nemotron_h.py) has every block kind, "MEM*E-MEM*E-":
Mamba-2, MoE, attention and MLP blocks in two layer groups; 8 gateless relu2 experts in 4 groups (2
kept), top-3, the random e_score_correction_bias moving the choice, normalised weights scaled by 2.5,
a shared expert. Checked: logits within 1e-4 of HF's over several lengths (NVIDIA's one-module-per-
expert layout, as HF saves it, and HF 5's fused `experts.up_proj`), each routing feature moving the
logits far beyond that bound, greedy decoding, and one engine (16-token steps, pages of 8, a small
pool, prefix caching) whose greedy output is HF's under chunked prefill, prefix-cache hits and
preemptions; what we refuse (latent MoE projections, other expert activations) with a message.
Tensor and expert parallelism: tests/test_nemotron_h_tp.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from models import load_model
from models.config import ConfigError
from models.mamba2_config import MAMBA, NO_MIXER, NO_MLP
from models.model import Model
from models.safetensors_io import read_json

FAMILY = "nemotron_h_moe"


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = tiny_checkpoint(FAMILY)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


def test_config_has_every_block_kind(ours, hf):
    cfg, hc = ours.cfg, hf.config
    assert cfg.num_layers == 12 and cfg.layer_period() == 6
    assert cfg.layer_types == (MAMBA, NO_MIXER, MAMBA, "full_attention", NO_MIXER, NO_MIXER) * 2
    assert cfg.mlp_types == (NO_MLP, "moe", NO_MLP, NO_MLP, "moe", "dense") * 2
    moe = cfg.deepseek_moe
    assert (cfg.num_experts, cfg.num_experts_per_tok, moe.n_group, moe.topk_group) == (
        hc.n_routed_experts,
        hc.num_experts_per_tok,
        hc.n_group,
        hc.topk_group,
    )
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (24, 40)
    assert moe.routed_scaling_factor == hc.routed_scaling_factor == 2.5 and cfg.norm_topk_prob


def test_logits_match_hf(ours, hf):
    for n in (1, 8, 23, 70):
        ids = random_prompt(ours.cfg.vocab_size, n, seed=n)
        err = np.abs(ours.logits(ids) - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"T={n}: max abs logit error {err:.2e}"


def test_fused_expert_layout_loads(ours, tiny_checkpoint, tmp_path):
    """transformers 5.x's own layout: `model.` prefix, experts fused to [E, I, H] / [E, H, I]."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint(FAMILY)
    tensors = {k.replace("backbone.", "model.", 1): v for k, v in load_file(src / "model.safetensors").items()}
    fused = {}
    for k in list(tensors):
        if ".experts.0." in k:
            stem, leaf = k.split(".experts.0.")
            fused[f"{stem}.experts.{leaf.removesuffix('.weight')}"] = np.stack(
                [tensors.pop(k.replace(".experts.0.", f".experts.{e}.")) for e in range(ours.cfg.num_experts)]
            )
    assert len(fused) == 8 and not any(".experts.1." in k for k in tensors)
    save_file({**tensors, **fused}, tmp_path / "model.safetensors")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    model = load_model(tmp_path, dtype="float32")
    ids = random_prompt(ours.cfg.vocab_size, 23, seed=23)
    np.testing.assert_array_equal(model.logits(ids), ours.logits(ids))


def test_each_routing_feature_moves_the_logits_beyond_the_tolerance(ours, hf):
    """Leaving out the selection bias, the group restriction, the weight normalisation or the
    routed scaling would fail `test_logits_match_hf` by orders of magnitude."""
    ids = random_prompt(ours.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf, ids)
    cfg, moe = ours.cfg, ours.cfg.deepseek_moe
    no_bias = {
        **ours.params,
        "groups": tuple(
            {**g, "e_score_bias": 0 * g["e_score_bias"]} if "e_score_bias" in g else g for g in ours.params["groups"]
        ),
    }
    variants = {
        "no e_score_correction_bias": (cfg, no_bias),
        "no group restriction": (dataclasses.replace(cfg, deepseek_moe=dataclasses.replace(moe, topk_group=4)), None),
        "no norm_topk_prob": (dataclasses.replace(cfg, norm_topk_prob=False), None),
        "routed_scaling_factor 1": (
            dataclasses.replace(cfg, deepseek_moe=dataclasses.replace(moe, routed_scaling_factor=1.0)),
            None,
        ),
    }
    for what, (variant_cfg, params) in variants.items():
        variant = Model(variant_cfg, params or ours.params, "float32", ours.path)
        err = np.abs(variant.logits(ids) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


def test_greedy_matches_hf_generate(ours, hf):
    ids = random_prompt(ours.cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf, ids, 16)
    assert_greedy_match(ours.greedy(ids, 16), expected, scores, "nemotron_h_moe prompt 30")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    from runtime.engine.llm_engine import LLMEngine

    config = small_engine_config(
        tiny_checkpoint(FAMILY),
        page_size=8,
        num_pages=24,
        max_num_batched_tokens=16,
        max_model_len=160,
        enable_prefix_caching=True,
        load_tokenizer=False,
    )
    return LLMEngine(config)


def _run(engine, prompts: dict, max_tokens: int) -> dict:
    from runtime.types import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    return drain(engine)


def test_engine_chunked_prefill_prefix_hits_and_preemption_match_hf(engine, hf):
    """Chunked prefill (16-token steps); prefix-cache hits: a continuation of a finished prompt (its
    end-of-prompt state checkpoint) and a shared 32-token prefix (the divergence checkpoint an
    earlier miss left); four 50-70-token requests generating 24 tokens each overflow the 24-page
    pool and preempt each other. Every output is HF's greedy one; every page and state slot comes back."""
    rng = np.random.default_rng(17)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    prompt = draw(41)
    done, lengths, prompts = {}, {}, {}
    for max_tokens, wave in (
        (8, dict(c0=draw(5), c1=prompt)),
        (8, dict(c2=prompt[:32] + draw(9), c3=prompt + draw(6))),
        (24, dict(c4=prompt[:32] + draw(7), p0=draw(50), p1=draw(70), p2=draw(60), p3=draw(55))),
    ):
        prompts.update(wave)
        lengths.update(dict.fromkeys(wave, max_tokens))
        done.update(_run(engine, wave, max_tokens))
    assert done["c3"].num_cached_tokens >= 24 and done["c4"].num_cached_tokens >= 24, done
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemptions"
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, lengths[rid])
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(moe_latent_size=16), "moe_latent_size"),
        (dict(n_group=3), "n_group"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(mlp_hidden_act="silu"), "relu2"),
    ],
)
def test_unsupported_moe_options_are_refused_at_load(tiny_checkpoint, tmp_path, change, match):
    src = tiny_checkpoint(FAMILY)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    hf_cfg = read_json(tmp_path / "config.json")
    hf_cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path)


def test_shipped_nemotron_3_nano_config():
    """configs/models/nemotron-3-nano-30b-a3b.json: 52 blocks (23 Mamba-2, 23 MoE, 6 attention), HF's
    own NemotronHConfig reads the same pattern, 31.6B parameters (the model card's total)."""
    import jax
    from transformers import NemotronHConfig

    from configs import CONFIG_DIR
    from models.config import parse_config
    from models.weights import abstract_params

    published = read_json(CONFIG_DIR / "models" / "nemotron-3-nano-30b-a3b.json")
    cfg = parse_config(published)
    text = NemotronHConfig(**{k: v for k, v in published.items() if not k.startswith("_")})
    assert [t == "moe" for t in text.layers_block_type] == [t == "moe" for t in cfg.mlp_types]
    assert (cfg.layer_types.count(MAMBA), cfg.mlp_types.count("moe"), cfg.num_attention_layers) == (23, 23, 6)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.deepseek_moe.routed_scaling_factor) == (128, 6, 2.5)
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 31.6e9 - 1) < 0.01, count


def test_jaxserve_plan_splits_nemotron_3_nano_over_a_tpu_v5e_8():
    """The v5e-8 config (TP8) pointed at Nemotron 3 Nano, shapes only (the compiled plan:
    benchmarks/results/plan/): 64 SSM heads / 8 groups, 2 KV heads held 4 times each, experts on
    their 1856 columns, all split 8 ways; the bf16 weights take under half of a 16 GiB chip."""
    from configs import CONFIG_DIR, load_config
    from runtime.aot.chip_report import plan_config

    name = "tpu-v5e-8-qwen3_5-27b.yaml"
    over = {"model.path": "/models/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "model.max_model_len": 32768}
    report = plan_config(load_config(CONFIG_DIR / name, over), name, token_buckets=(), compile_sampler=False)
    assert report.fits, report.problems
    assert abs(report.param_count / 31.6e9 - 1) < 0.01
    assert report.weight_bytes < 8 * 2**30, report.weight_bytes  # per chip
    assert report.kv_bytes_per_token == 2 * 6 * 128  # fp8 K and V of one held KV head per chip, 6 layers
