"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: MLA + DeepSeek MoE) against HF transformers on tiny fp32 checkpoints.

Two checkpoints (models/random_deepseek.py): `deepseek_v3` (q LoRA, YaRN RoPE with mscale !=
mscale_all_dim, interleaved RoPE pairs, a dense first layer, 4 expert groups of which 2 are kept)
and `deepseek_v3_qnone` (plain q_proj, default RoPE, four MoE layers scanned, unnormalized top-k).
The routers' `e_score_correction_bias` is random, so selection differs from scoring. HF runs with
eager attention, expanding the latent per head; ours caches one latent row per token and absorbs
the up-projections (models/mla_attention.py). Checked: the parsed config against HF's own modules
(softmax scale, RoPE tables), logits within 1e-4 through the paged forward on every CPU path,
greedy decoding through the paged latent cache, that each DeepSeek feature moves the logits far
beyond the tolerance, the engine's greedy output under chunked prefill, prefix-cache hits and
preemption (one engine for all three), FP8 latent pages, the KV bytes per token from the config
against the equivalent MHA's, the shipped DeepSeek-V3 config, and what is refused at start-up.
"""

from __future__ import annotations

import contextlib
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
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from configs import CONFIG_DIR
from models import load_model
from models.config import ConfigError, parse_config
from models.model import Model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from models.weights import abstract_params

FAMILIES = ("deepseek_v3", "deepseek_v3_qnone")
LENGTHS = (1, 7, 16, 23, 70)  # pages of 16: within one, exactly one, across several


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    """family -> HF's DeepseekV3ForCausalLM in float32 with eager attention, loaded once."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    loaded = {}

    def get(family: str):
        if family not in loaded:
            path = tiny_checkpoint(family)
            loaded[family] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return loaded[family]

    return get


@pytest.fixture(scope="module")
def ours(tiny_checkpoint):
    loaded = {}

    def get(family: str) -> Model:
        if family not in loaded:
            loaded[family] = load_model(tiny_checkpoint(family), dtype="float32")
        return loaded[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_config_matches_hf_modules(ours, hf, family):
    """The softmax scale (mscale**2 under YaRN), the RoPE inverse frequencies and their cos/sin
    factor, the layer kinds and the router settings, read off HF's own instantiated modules."""
    cfg, model = ours(family).cfg, hf(family)
    hf_cfg = model.config
    attn = model.model.layers[0].self_attn
    assert cfg.mla.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    rotary = model.model.rotary_emb
    inv_freq, scale = cfg.inv_freq()
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-6)
    assert cfg.mla.q_lora_rank == (hf_cfg.q_lora_rank or 0) and cfg.mla.rope_interleave == hf_cfg.rope_interleave
    kinds = tuple("moe" if type(layer.mlp).__name__ == "DeepseekV3MoE" else "dense" for layer in model.model.layers)
    assert cfg.mlp_types == kinds
    gate = next(layer.mlp.gate for layer in model.model.layers if kinds[layer.self_attn.layer_idx] == "moe")
    assert (cfg.deepseek_moe.n_group, cfg.deepseek_moe.topk_group) == (gate.num_group, gate.topk_group)
    assert cfg.deepseek_moe.routed_scaling_factor == gate.routed_scaling_factor
    assert cfg.norm_topk_prob == gate.norm_topk_prob and cfg.num_experts_per_tok == gate.top_k
    assert float(gate.e_score_correction_bias.abs().max()) > 0.01  # random: selection != scoring
    if family == "deepseek_v3":
        assert attn.scaling != pytest.approx((12 + 8) ** -0.5) and scale != pytest.approx(1.0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["auto", "reference", "chunked"])
def test_logits_match_hf(ours, hf, family, attention):
    """Every CPU MLA path ("auto" is the native one) through the paged latent cache."""
    model = ours(family)
    for n in LENGTHS:
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        expected = hf_logits(hf(family), ids)
        got = model.logits(ids, KernelOptions(attention=attention))
        err = np.abs(got - expected).max()
        assert err <= 1e-4, f"{family} attention={attention} T={n}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_through_the_tpu_mla_kernel_interpreted(ours, hf, family):
    """The Pallas TPU MLA kernel (interpret mode) inside the model. (The GPU kernel needs rows of
    a multiple of 16 channels: DeepSeek-V3's 576, not these 28.)"""
    for n in (23, 70):
        ids = random_prompt(ours(family).cfg.vocab_size, n, seed=n)
        got = ours(family).logits(ids, KernelOptions(attention="pallas_tpu", interpret=True))
        err = np.abs(got - hf_logits(hf(family), ids)).max()
        assert err <= 1e-4, f"{family} T={n}: max abs logit error {err:.2e}"


def test_logits_match_hf_unrolled(tiny_checkpoint, hf):
    """The unrolled layer loop (the CPU plan's) on the scanned checkpoint's four groups."""
    model = load_model(tiny_checkpoint("deepseek_v3_qnone"), dtype="float32")
    model.unstack_layers()
    ids = random_prompt(model.cfg.vocab_size, 40, seed=40)
    err = np.abs(model.logits(ids) - hf_logits(hf("deepseek_v3_qnone"), ids)).max()
    assert err <= 1e-4, err


def test_each_feature_moves_the_logits_beyond_the_tolerance(ours, hf):
    """Leaving out any DeepSeek feature would fail `test_logits_match_hf` by orders of magnitude."""
    base = ours("deepseek_v3")
    ids = random_prompt(base.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf("deepseek_v3"), ids)
    cfg = base.cfg
    no_bias = dict(base.params)
    no_bias["groups"] = tuple(
        {**g, "e_score_bias": 0 * g["e_score_bias"]} if "e_score_bias" in g else g for g in base.params["groups"]
    )
    variants = {
        "RoPE pairs not interleaved": (dict(mla=dataclasses.replace(cfg.mla, rope_interleave=False)), base.params),
        "softmax scale without mscale**2": (
            dict(mla=dataclasses.replace(cfg.mla, softmax_scale=20**-0.5)),
            base.params,
        ),
        "no routed scaling": (
            dict(deepseek_moe=dataclasses.replace(cfg.deepseek_moe, routed_scaling_factor=1.0)),
            base.params,
        ),
        "no expert groups": (
            dict(deepseek_moe=dataclasses.replace(cfg.deepseek_moe, n_group=1, topk_group=1)),
            base.params,
        ),
        "no correction bias": ({}, no_bias),
        "top-k weights not normalized": (dict(norm_topk_prob=False), base.params),
    }
    for what, (change, params) in variants.items():
        variant = Model(dataclasses.replace(cfg, **change), params, "float32", base.path)
        err = np.abs(variant.logits(ids) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(ours, hf, family):
    ids = random_prompt(ours(family).cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf(family), ids, 20)  # decode crosses pages of 16
    assert_greedy_match(ours(family).greedy(ids, 20), expected, scores, f"{family} prompt 30")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(tiny_checkpoint, hf, family):
    """bf16 weights and activations (the router in float32, as HF keeps it): per position, our
    logits are as close to HF's float32 ones as HF's own bfloat16 model's are, within 2x at the
    median. The median, because in bf16 a near-tied expert choice flips at a few positions in
    either model (max errors ~1-3 for both on these prompts), not at the same ones."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family)
    model = load_model(path, dtype="bfloat16")
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    for seed in (1, 3):
        ids = random_prompt(model.cfg.vocab_size, 65, seed=seed)
        reference = hf_logits(hf(family), ids)
        ours = np.median(np.abs(np.asarray(model.logits(ids), np.float32) - reference).max(-1))
        theirs = np.median(np.abs(hf_logits(hf_bf16, ids) - reference).max(-1))
        assert theirs > 0 and ours <= 2 * theirs, f"seed {seed}: ours {ours:.3e} vs HF bf16 {theirs:.3e}"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """One engine for the engine tests: 16-token steps (chunked prefill), prefix caching, and a
    pool of 30 pages of 8 that four ~90-token requests overflow (preemption)."""
    from runtime.engine.llm_engine import LLMEngine

    config = small_engine_config(
        tiny_checkpoint("deepseek_v3"),
        page_size=8,
        num_pages=30,
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


def test_engine_chunked_prefill_greedy_matches_hf(engine, hf):
    """16-token steps: every prompt but the first is prefilled in chunks, decodes riding along."""
    vocab = engine.model.cfg.vocab_size
    prompts = {f"c{i}": random_prompt(vocab, n, seed=500 + i) for i, n in enumerate((5, 41, 19, 33))}
    outputs = _run(engine, prompts, 10)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf("deepseek_v3"), ids, 10)
        assert_greedy_match(outputs[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


def test_engine_prefix_hits_and_preemption_match_hf(engine, hf):
    """Prefix-cache hits and preemptions: every output still HF's greedy one, every page back."""
    rng = np.random.default_rng(17)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    prompt, prompts, done = draw(45), {}, {}
    done.update(_run(engine, {"p0": prompt}, 10))
    prompts["p0"] = prompt
    wave = {
        "p1": prompt + done["p0"].outputs[0].token_ids + draw(7),
        "p2": prompt[:30] + draw(12),
        "p3": draw(60),
        "p4": draw(50),
    }
    preempted = engine.stats()["num_preemptions"]
    done.update(_run(engine, wave, 30))
    prompts.update(wave)
    stats = engine.stats()
    assert stats["num_preemptions"] > preempted, "the pool was meant to force preemptions"
    assert done["p1"].num_cached_tokens >= 48 and done["p2"].num_cached_tokens == 24
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats
    for rid, ids in prompts.items():
        n = len(done[rid].outputs[0].token_ids)
        expected, scores = hf_greedy(hf("deepseek_v3"), ids, n)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@contextlib.contextmanager
def hf_fp8_rows(model, page_size: int, dtype=torch.float8_e4m3fn):
    """HF's model with its latent rows [kv_a_layernorm(c) | rope(k_pe)] rounded to FP8 as pages of
    `page_size` written in one prefill hold them: one scale per page, amax / fmax, clipped. Patches
    HF's RoPE function (which returns k_pe) and rounds the normed latent, a view HF attends to, in
    place. No cache: for full-sequence logits."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf_deepseek

    limit = torch.finfo(dtype).max
    latest = {}
    hooks = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, i, out: latest.update(c=out))
        for layer in model.model.layers
    ]
    name = "apply_rotary_pos_emb_interleave" if model.config.rope_interleave else "apply_rotary_pos_emb"
    rope = getattr(hf_deepseek, name)

    def rounded(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        c = latest["c"]  # [1, S, L]; k: [1, 1, S, R]
        rows = torch.cat([c[0], k[0, 0]], dim=-1)
        out = torch.empty_like(rows)
        for s in range(0, rows.shape[0], page_size):
            scale = torch.tensor(max(float(rows[s : s + page_size].abs().max()) / limit, 1e-30))
            out[s : s + page_size] = (rows[s : s + page_size] / scale).clamp(-limit, limit).to(dtype).float() * scale
        c.copy_(out[None, :, : c.shape[-1]])
        return q, out[None, None, :, c.shape[-1] :].contiguous()

    setattr(hf_deepseek, name, rounded)
    try:
        yield
    finally:
        setattr(hf_deepseek, name, rope)
        for hook in hooks:
            hook.remove()


def test_fp8_latent_pages(tiny_checkpoint, ours, hf):
    """FP8 (e4m3) latent rows with one scale per page: the logits equal HF's with its latent rows
    rounded to FP8 the same way (within 1e-4; FP8 itself moves them by ~1 on this model), and the
    engine holds one byte per channel and picks the oracle's first token for each prompt."""
    from runtime.engine.llm_engine import LLMEngine

    model, reference = ours("deepseek_v3"), hf("deepseek_v3")
    ids = random_prompt(model.cfg.vocab_size, 70, seed=71)
    with hf_fp8_rows(reference, page_size=16):
        expected = hf_logits(reference, ids)
    got = model.logits(ids, kv_dtype="fp8_e4m3", page_size=16)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(got - hf_logits(reference, ids)).max() > 1e-2  # the rows really were FP8

    config = small_engine_config(
        tiny_checkpoint("deepseek_v3"), page_size=8, kv_cache_dtype="fp8_e4m3", load_tokenizer=False
    )
    engine = LLMEngine(config)
    latent = engine.caches["kv"][0]
    assert latent.dtype == jax.numpy.float8_e4m3fn and latent.c_scale is not None and latent.bytes_per_token() == 29
    prompts = {f"f{i}": random_prompt(model.cfg.vocab_size, n, seed=700 + i) for i, n in enumerate((9, 37))}
    outputs = _run(engine, prompts, 4)  # each prompt prefilled in one step: its pages as the oracle's
    for rid, prompt in prompts.items():
        with hf_fp8_rows(reference, page_size=8):
            last = hf_logits(reference, prompt)[-1]
        top2 = np.sort(last)[-2:]
        token = outputs[rid].outputs[0].token_ids[0]
        assert token == int(np.argmax(last)) or top2[1] - top2[0] < 1e-3, (rid, token)
        assert len(outputs[rid].outputs[0].token_ids) == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_bytes_per_token_mla_vs_mha(ours, tiny_checkpoint, family):
    """The engine's KV accounting: one row of kv_lora_rank + qk_rope_head_dim per token and layer,
    against K (nope + rope per head) and V (v_head_dim per head) for every head in MHA; read off
    config.json, not our parser. The pool the engine sizes from a byte budget follows it."""
    from runtime.engine.construction import default_num_pages

    hf_cfg = read_json(tiny_checkpoint(family) / "config.json")
    layers, heads = hf_cfg["num_hidden_layers"], hf_cfg["num_attention_heads"]
    mla_row = hf_cfg["kv_lora_rank"] + hf_cfg["qk_rope_head_dim"]
    mha_row = heads * (hf_cfg["qk_nope_head_dim"] + hf_cfg["qk_rope_head_dim"] + hf_cfg["v_head_dim"])
    model = ours(family)
    for kv_dtype, itemsize in (("auto", 4), ("bfloat16", 2), ("fp8_e4m3", 1)):
        got = model.cache_bytes_per_token(kv_dtype)
        assert got == mla_row * itemsize * layers, (kv_dtype, got)
        assert got < mha_row * itemsize * layers
    caches = model.init_caches(5, 8, 2, "bfloat16")
    assert sum(c.bytes_per_token() for c in caches["kv"]) * model.num_groups == mla_row * 2 * layers
    budget = 1 << 20
    config = small_engine_config(
        model.path, page_size=8, num_pages=None, kv_cache_memory_bytes=budget, max_num_seqs=64, max_model_len=1024
    )
    assert default_num_pages(config, model, 128, 0) == budget // (mla_row * 4 * layers * 8)


def test_shipped_deepseek_v3_config():
    """configs/models/deepseek-v3.json is DeepSeek's published config.json (its FP8 block
    `quantization_config` left out, as for gpt-oss's mxfp4): 61 layers, 3 dense, 256 experts top-8
    in 8 groups of which 4 are kept; YaRN x40 with mscale 1, so the softmax scale is
    192**-0.5 * (0.1 ln 40 + 1)**2; HF's DeepseekV3Config reads the same file the same way; about
    671B parameters (the main model, without its MTP module)."""
    from transformers import DeepseekV3Config

    published = read_json(CONFIG_DIR / "models" / "deepseek-v3.json")
    cfg = parse_config(published)
    hf_cfg = DeepseekV3Config(**published)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.num_layers == 61 and cfg.vocab_size == 129280
    assert cfg.mlp_types == ("dense",) * 3 + ("moe",) * 58
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.latent_width) == (1536, 512, 576)
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert (cfg.rope_type, dict(cfg.rope_scaling)["factor"], cfg.rotary_dim) == ("yarn", 40, hf_cfg.qk_rope_head_dim)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.deepseek_moe.n_group, cfg.deepseek_moe.topk_group) == (
        hf_cfg.n_routed_experts,
        hf_cfg.num_experts_per_tok,
        hf_cfg.n_group,
        hf_cfg.topk_group,
    )
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 671e9 - 1) < 0.01, count


TP_SCRIPT = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 5)
import numpy as np
from models.model import load_model
from models.sharding import shard_model
from runtime.engine.construction import default_num_pages
from runtime.engine_config import EngineConfig
from runtime.parallel.mesh import make_mesh

ids = np.random.default_rng(0).integers(3, 1031, size=40).tolist()
for path, devices, ep in ((sys.argv[1], 5, False), (sys.argv[2], 2, True)):
    ref = load_model(path).logits(ids)
    model = shard_model(load_model(path), make_mesh(1, devices, devices=jax.devices()[:devices]), expert_parallel=ep)
    group = next(g for g in model.params["groups"] if "experts_down" in g)
    split = "q_b_proj" in model.params["groups"][0] and len(model.params["groups"][0]["q_b_proj"].sharding.device_set) == 5
    print("SPLIT", model.tp.attention, model.tp.expert, split, group["experts_down"].sharding.spec)
    print("ERR", float(np.abs(model.logits(ids) - ref).max()))
    config = EngineConfig(model=path, page_size=8, kv_cache_memory_bytes=1 << 20, max_num_seqs=64, max_model_len=1024)
    print("PAGES", default_num_pages(config, model, 128, 0), model.cache_bytes_per_token())
"""


def test_tensor_and_expert_parallel_logits_match_single_device(tiny_checkpoint):
    """5 devices: the 5 query heads split (q_b_proj / kv_b_proj columns, o_proj rows), the latent
    rows replicated (the pool sized from a byte budget counts every row on every device); 2 devices
    with expert parallelism: the 6 routed experts 3 per device, attention replicated (5 heads). A
    subprocess: the device count must not leak. Same logits as one device."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    paths = [str(tiny_checkpoint(f)) for f in FAMILIES]
    proc = subprocess.run(
        [sys.executable, "-c", TP_SCRIPT, *paths], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    splits = [x for x in proc.stdout.splitlines() if x.startswith("SPLIT ")]
    errs = [float(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("ERR ")]
    assert splits[0].startswith("SPLIT True False True") and splits[1].startswith("SPLIT False True"), splits
    assert len(errs) == 2 and max(errs) <= 1e-5, errs
    pools = [tuple(map(int, x.split()[1:])) for x in proc.stdout.splitlines() if x.startswith("PAGES ")]
    assert len(pools) == 2 and all(pages == (1 << 20) // (per_token * 8) for pages, per_token in pools), pools


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("scoring_func", "softmax", "scoring_func"),
        ("topk_method", "greedy", "topk_method"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("attention_bias", True, "attention_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("n_group", 3, "n_group"),
        ("num_experts_per_tok", 7, "num_experts_per_tok"),
        ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ],
)
def test_unsupported_options_are_refused_at_load(tiny_checkpoint, tmp_path, field, value, match):
    src = tiny_checkpoint("deepseek_v3")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    hf_cfg = read_json(tmp_path / "config.json")
    hf_cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path)


def test_mla_impl_follows_the_attention_back_end():
    """The MLA op's implementation: the attention back-end's name where the op has it, else the
    op's "auto" on the platform (the target one for a named Pallas kernel: `jaxserve plan` compiles
    for a TPU from this CPU host, where the native C++ call does not exist), else "chunked"; and
    "chunked" where the chosen kernel cannot read pages held as raw bits."""
    from models.mla_attention import mla_impl
    from pallas_kernels.mla import LatentPages

    floats, bits = LatentPages.create(2, 8, 28, "float32"), LatentPages.create(2, 8, 28, "bfloat16", bit_storage=True)
    cases = [
        ("auto", False, floats, "native"),
        ("reference", False, bits, "reference"),
        ("chunked", False, bits, "chunked"),
        ("pallas_tpu", False, floats, "pallas_tpu"),
        ("pallas_gpu", False, floats, "pallas_gpu"),
        ("pallas", True, floats, "pallas"),  # interpret mode on CPU
        ("pallas_tpu", False, bits, "chunked"),  # the kernels read float pages only
    ]
    for attention, interpret, latent, want in cases:
        assert mla_impl(KernelOptions(attention=attention, interpret=interpret), latent) == want, attention


DP_SCRIPT = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

def run(mesh_shape):
    engine = LLMEngine(EngineConfig(model=sys.argv[1], load_tokenizer=False, mesh_shape=mesh_shape, page_size=8,
                                    num_pages=40, max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(4, 16),
                                    max_model_len=96, enable_prefix_caching=True, aot_compile=False))
    rng, done = np.random.default_rng(0), {}
    for i, n in enumerate([5, 30, 9, 23]):
        params = SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", rng.integers(3, 1000, n).tolist(), params))
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    return done, engine.stats()["pages_used"]

print("DP", run((2, 1)) == run(None))
"""


@pytest.mark.slow  # two engines in a subprocess (~1.5-5 min here), as the other families' DP engine tests
def test_attention_data_parallel_engine_matches_one_device(tiny_checkpoint):
    """Two attention-DP ranks (each its own latent pages and batch, in a subprocess with 2 CPU
    devices): the same greedy tokens as the one-device engine, every page back."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", DP_SCRIPT, str(tiny_checkpoint("deepseek_v3"))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DP True" in proc.stdout.splitlines(), proc.stdout[-2000:]
