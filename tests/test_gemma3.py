"""Gemma 3 (`Gemma3ForCausalLM`, text) against HF transformers' own model on the tiny fp32 checkpoint.

Six layers, local : global 2 : 1 with a window of 7, local and global RoPE bases (linear scaling on
the global layers), QK norm, `query_pre_attn_scalar` != head_dim, embeddings scaled by
sqrt(hidden), four zero-centred norms per layer, gelu-tanh MLP, tied embeddings and a final logit
soft-cap (models/random_gemma3.py). HF runs with eager attention. Prompts run many windows long and
across pages of 16. Checked: logits within 1e-4 through the paged forward (layer scan and unrolled;
the CPU's native attention, the jnp paths, the TPU and GPU Pallas kernels interpreted), greedy
decoding through the paged caches, the engine's greedy output under chunked prefill with its
sampled-token and prompt logprobs (the soft-cap in the sampler and scoring programs) and under
prefix-cache hits and preemptions (nothing leaked), bf16 logits as close to HF's fp32 ones as
HF's own bf16 model, that each Gemma feature changes the logits far beyond the tolerance (so the
comparison would catch its omission), the abstract parameter tree, tensor parallelism on a
2-device CPU mesh, Google's multimodal checkpoint layout, the shipped Gemma-3-27B config, and the
options we do not support refused at load.
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

from configs import CONFIG_DIR
from models import load_model
from models.config import ConfigError, parse_config
from models.model import Model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from models.weights import abstract_params

FAMILY = "gemma3"
LENGTHS = (1, 7, 8, 23, 70, 150)  # window 7: one window, just past it, many windows, many pages


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    """HF's Gemma3ForCausalLM in float32 with eager attention (its reference attention path)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = tiny_checkpoint(FAMILY)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    return load_model(tiny_checkpoint(FAMILY), dtype="float32")


def test_config_parses_windows_ropes_and_gemma_fields(ours, tiny_checkpoint):
    hf_cfg = read_json(tiny_checkpoint(FAMILY) / "config.json")
    cfg = ours.cfg
    assert cfg.architecture == "Gemma3ForCausalLM" and hf_cfg["layer_types"][2] == "full_attention"
    assert cfg.sliding_windows == (7, 7, 0, 7, 7, 0) and cfg.layer_period() == 3
    assert cfg.zero_centred_norm and cfg.qk_norm and cfg.sandwich_norms and cfg.scale_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert cfg.attention_scale == pytest.approx(40**-0.5) and cfg.final_logit_softcapping == 1.5
    assert (cfg.rope_theta, cfg.rope_type, dict(cfg.rope_scaling)) == (100000.0, "linear", {"factor": 8.0})
    assert (cfg.sliding_rope_theta, cfg.sliding_rope_type) == (100.0, "default") and cfg.has_sliding_rope
    global_inv, _ = cfg.inv_freq()
    local_inv, _ = cfg.inv_freq(sliding=True)
    np.testing.assert_allclose(local_inv, 100.0 ** -(np.arange(0, 16, 2) / 16), rtol=1e-6)
    np.testing.assert_allclose(global_inv, 100000.0 ** -(np.arange(0, 16, 2) / 16) / 8, rtol=1e-6)


def test_hf_eager_and_sdpa_agree(hf, hf_model):
    """The shared `hf_model` fixture (HF's default sdpa attention) is the same oracle as eager."""
    ids = random_prompt(hf.config.vocab_size, 70, seed=7)
    np.testing.assert_allclose(hf_logits(hf_model(FAMILY), ids), hf_logits(hf, ids), atol=1e-5)


@pytest.mark.parametrize("attention,unrolled", [("auto", False), ("auto", True), ("reference", False)])
def test_logits_match_hf(ours, hf, attention, unrolled):
    model = load_model(ours.path, dtype="float32") if unrolled else ours
    if unrolled:
        model.unstack_layers()
    for n in LENGTHS:
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        expected = hf_logits(hf, ids)
        got = model.logits(ids, KernelOptions(attention=attention))
        assert got.shape == expected.shape
        err = np.abs(got - expected).max()
        assert err <= 1e-4, f"attention={attention} unrolled={unrolled} T={n}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
def test_logits_match_hf_through_the_pallas_kernels_interpreted(ours, hf, kernel):
    """The TPU and GPU attention kernels (interpret mode) with this model's windows and scale."""
    for n in (23, 70):
        ids = random_prompt(ours.cfg.vocab_size, n, seed=n)
        got = ours.logits(ids, KernelOptions(attention=kernel, interpret=True))
        err = np.abs(got - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"{kernel} T={n}: max abs logit error {err:.2e}"


def test_each_feature_moves_the_logits_beyond_the_tolerance(ours, hf):
    """Every Gemma 3 feature matters on these prompts: leaving any of them out would fail
    `test_logits_match_hf` by orders of magnitude."""
    ids = random_prompt(ours.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf, ids)
    cfg = ours.cfg
    variants = {
        "no QK norm": dict(qk_norm=False),
        "1/sqrt(head_dim) scale": dict(query_pre_attn_scalar=0.0),
        "unscaled embeddings": dict(scale_embeddings=False),
        "global RoPE on local layers": dict(sliding_rope_theta=0.0),
        "no window": dict(sliding_windows=(1000, 1000, 0, 1000, 1000, 0)),  # same layer groups
        "no post-attention / post-MLP norms": dict(sandwich_norms=False),
        "no final soft-cap": dict(final_logit_softcapping=None),
        "silu MLP": dict(hidden_act="silu"),
        "plain RMSNorm weights": dict(zero_centred_norm=False),
    }
    for what, change in variants.items():
        variant = Model(dataclasses.replace(cfg, **change), ours.params, "float32", ours.path)
        err = np.abs(variant.logits(ids) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


def test_greedy_matches_hf_generate(ours, hf):
    ids = random_prompt(ours.cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf, ids, 24)  # decode runs past several windows
    assert_greedy_match(ours.greedy(ids, 24), expected, scores, "gemma3 prompt 30")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()


@pytest.mark.parametrize("layer_loop", ["auto", "scan"])  # auto on CPU: layers unrolled
def test_engine_chunked_prefill_greedy_matches_hf(tiny_checkpoint, hf, layer_loop):
    """16-token steps: every prompt but the first is prefilled in chunks, with decodes riding along.
    The generated tokens' logprobs and one request's prompt logprobs match HF's soft-capped logits
    (the sampler and scoring programs apply `final_logit_softcapping` too)."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint(FAMILY)
    config = small_engine_config(path, max_num_batched_tokens=16, load_tokenizer=False, layer_loop=layer_loop)
    engine = LLMEngine(config)
    vocab = engine.model.cfg.vocab_size
    prompts = {f"r{i}": random_prompt(vocab, n, seed=500 + i) for i, n in enumerate((5, 41, 19, 66))}
    for rid, ids in prompts.items():
        params = SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0 if rid == "r2" else None
        )
        engine.add_request(EngineRequest(rid, ids, params))
    outputs = drain(engine)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, 10)
        got = outputs[rid].outputs[0]
        assert_greedy_match(got.token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")
        if got.token_ids == expected:
            reference = _log_softmax(scores)
            for i, entry in enumerate(got.logprobs):
                assert abs(entry.logprob - reference[i, entry.token_id]) < 1e-4, (rid, i)
    reference = _log_softmax(hf_logits(hf, prompts["r2"]))
    scored = outputs["r2"].prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == len(prompts["r2"])
    for i in range(1, len(scored)):
        assert abs(scored[i].logprob - reference[i - 1, prompts["r2"][i]]) < 1e-4, i


def test_engine_prefix_hits_and_preemption_match_hf(tiny_checkpoint, hf):
    """Prefix-cache hits many windows deep and preemptions (a pool of 28 pages of 8 for four
    requests of ~80-90 tokens): every output still HF's greedy one, and every page comes back."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    config = small_engine_config(
        tiny_checkpoint(FAMILY),
        page_size=8,
        num_pages=28,
        max_num_batched_tokens=32,
        max_model_len=160,
        enable_prefix_caching=True,
        load_tokenizer=False,
    )
    engine = LLMEngine(config)
    rng = np.random.default_rng(17)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    prompt, prompts, done = draw(45), {}, {}

    def wave(max_tokens: int, **new):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts.update(new)
        for rid, ids in new.items():
            engine.add_request(EngineRequest(rid, ids, params))
        done.update(drain(engine))

    wave(10, r0=prompt)
    wave(30, r1=prompt + done["r0"].outputs[0].token_ids + draw(7), r2=prompt[:30] + draw(12), r3=draw(60), r4=draw(50))
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemptions"
    assert done["r1"].num_cached_tokens >= 24 and done["r2"].num_cached_tokens == 24
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats
    for rid, ids in prompts.items():
        n = len(done[rid].outputs[0].token_ids)
        expected, scores = hf_greedy(hf, ids, n)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(tiny_checkpoint, hf, layout):
    """bf16 weights, as loaded and in the CPU plan's packed layout (`Model.hold_packed`): our
    logits are as close to HF's float32 ones as HF's own bfloat16 model's are (within 2x)."""
    assert_bf16_as_close_as_hf_bf16(tiny_checkpoint(FAMILY), hf, layout, attn_implementation="eager")


def test_shipped_gemma_3_27b_config():
    """configs/models/gemma-3-27b.json is Google's published config.json (the multimodal wrapper; its
    text_config leaves most fields to HF's defaults): 62 layers, 5 local (window 1024, RoPE base 10k)
    per global one (base 1M, linear x8), query_pre_attn_scalar 168 != head_dim 128; HF's own
    Gemma3TextConfig reads the same file the same way; about 27.0B language-model parameters."""
    from transformers import Gemma3Config

    published = read_json(CONFIG_DIR / "models" / "gemma-3-27b.json")
    cfg = parse_config(published)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 62 and cfg.vocab_size == 262208
    text = Gemma3Config(**published).text_config
    assert cfg.sliding_windows == tuple(1024 if t == "sliding_attention" else 0 for t in text.layer_types)
    assert sum(w == 0 for w in cfg.sliding_windows) == 10 and cfg.layer_period() == 62
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_type, dict(cfg.rope_scaling)) == (full["rope_theta"], "linear", {"factor": 8.0})
    assert (
        (cfg.sliding_rope_theta, cfg.sliding_rope_type) == (local["rope_theta"], local["rope_type"]) == (1e4, "default")
    )
    assert cfg.attention_scale == pytest.approx(168**-0.5) and cfg.final_logit_softcapping is None
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_act) == (32, 16, 128, text.hidden_activation)
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 27.0e9 - 1) < 0.02, count


def test_published_multimodal_layout_serves_its_text_model(ours, tiny_checkpoint, tmp_path):
    """Google's checkpoints are `Gemma3ForConditionalGeneration`: the config wraps a `text_config`
    and the language model's tensors live under `language_model.model.` beside the vision tower's."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint(FAMILY)
    tensors = {"language_model." + k: v for k, v in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    text = {k: v for k, v in read_json(src / "config.json").items() if k != "architectures"}
    wrapper = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    model = load_model(tmp_path, dtype="float32")
    assert model.cfg == dataclasses.replace(ours.cfg, eos_token_ids=model.cfg.eos_token_ids)
    ids = random_prompt(ours.cfg.vocab_size, 23, seed=23)
    np.testing.assert_array_equal(model.logits(ids), ours.logits(ids))


TP_SCRIPT = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from models.model import load_model
from models.sharding import shard_model
from runtime.parallel.mesh import make_mesh

ids = np.random.default_rng(0).integers(3, 1031, size=40).tolist()
ref = load_model(sys.argv[1]).logits(ids)
model = shard_model(load_model(sys.argv[1]), make_mesh(1, 2, devices=jax.devices()[:2]))
norm = model.params["groups"][0]["attn_out_norm"]
assert model.tp.attention and len(norm.sharding.device_set) == 2, model.tp
print("ERR", float(np.abs(model.logits(ids) - ref).max()))
"""


def test_tensor_parallel_logits_match_single_device(tiny_checkpoint):
    """Heads split over a 2-device CPU mesh (a subprocess: the device count must not leak): the same
    logits as one device, the sandwich norms placed by their sharding rule."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, str(tiny_checkpoint(FAMILY))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ERR ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    assert float(line.split()[1]) <= 1e-5, line


def test_hf_ignores_attn_logit_softcapping(hf):
    """Why a config with attn_logit_softcapping is refused rather than served: HF transformers'
    Gemma3 attention never applies it, so there is no reference behaviour to match."""
    ids = random_prompt(hf.config.vocab_size, 23, seed=23)
    before = hf_logits(hf, ids)
    hf.config.attn_logit_softcapping = 0.05
    try:
        np.testing.assert_array_equal(hf_logits(hf, ids), before)
    finally:
        hf.config.attn_logit_softcapping = None


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("hidden_activation", "relu", "hidden_activation"),
        ("layer_types", ["chunked_attention"] * 6, "layer_types"),
    ],
)
def test_unsupported_options_are_refused_at_load(tiny_checkpoint, tmp_path, field, value, match):
    src = tiny_checkpoint(FAMILY)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    hf_cfg = read_json(tmp_path / "config.json")
    hf_cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path)
