"""Kimi Linear (`KimiLinearForCausalLM`: KDA + NoPE MLA + DeepSeek MoE) against HF transformers on tiny fp32 checkpoints.

Two checkpoints (models/random_kimi.py): `kimi_linear` (KDA, KDA, MLA, KDA, KDA; the first layer
dense; plain q_proj; 4 expert groups of which 2 are kept) and `kimi_linear_qlora` (KDA, MLA twice,
scanned as two groups; q LoRA; a 3-tap short conv; unnormalized top-k), both saved with Moonshot's
tensor names as published. HF runs with eager attention and its torch KDA (chunked for prefill,
recurrent for a one-token decode). Checked: the parsed config against HF's own modules, logits
within 1e-4 through the paged forward on every CPU KDA path and through the Pallas KDA and MLA
kernels interpreted, greedy decoding through KDA state slots and MLA latent pages, that each Kimi
feature moves the logits far beyond the tolerance, FP8 latent pages, the engine's greedy output
under chunked prefill, prefix-cache hits (KDA state checkpoints as GDN's) and preemption with every
page and state slot back (one engine for all), the state and KV bytes from config.json, HF's
in-memory tensor names, the shipped Kimi-Linear-48B-A3B config, and what is refused at start-up.
Tensor, expert and attention-data parallelism: tests/test_kimi_linear_parallel.py.
The default run keeps the core exactness checks (the config, fp32 logits vs HF on the CPU KDA
path, the engine's greedy output vs HF under chunked prefill, prefix hits and preemption, the
byte accounting, what is refused); the other paths and features run under `-m slow`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_bf16_as_close_as_hf_bf16, assert_greedy_match, hf_greedy, hf_logits, random_prompt
from kernel_testing import gpu_kernel_interpret

from configs import CONFIG_DIR
from models import load_model
from models.config import ATTENTION, LINEAR, ConfigError, parse_config
from models.model import Model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from models.weights import abstract_params

FAMILIES = ("kimi_linear", "kimi_linear_qlora")
LENGTHS = (1, 7, 16, 23, 70)  # pages of 16; KDA chunks of 16 (CPU) and 64 (HF): within one, across several
# the per-token path has no chunks of its own: one page, across pages, across HF's 64-token chunk
AUTO_LENGTHS = (1, 23, 70)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    """family -> HF's KimiLinearForCausalLM in float32 with eager attention, loaded once."""
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
    """Layer and MLP kinds, KDA heads / dims / conv taps, the MLA softmax scale, the router's
    settings, read off HF's own instantiated modules."""
    cfg, model = ours(family).cfg, hf(family)
    layers = model.model.layers
    kinds = tuple(ATTENTION if type(x.self_attn).__name__ == "KimiLinearAttention" else LINEAR for x in layers)
    assert cfg.layer_types == kinds and cfg.kda and len(set(kinds)) == 2
    mlps = tuple("moe" if type(x.mlp).__name__ == "KimiLinearMoE" else "dense" for x in layers)
    assert cfg.mlp_types == mlps
    kda = next(x.self_attn for x in layers if type(x.self_attn).__name__ == "KimiLinearDeltaAttention")
    assert (cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (kda.num_heads, kda.head_dim)
    assert cfg.linear_conv_kernel_dim == kda.conv_kernel_size and cfg.conv_dim == kda.conv_dim
    mla = next(x.self_attn for x in layers if type(x.self_attn).__name__ == "KimiLinearAttention")
    assert cfg.mla.softmax_scale == pytest.approx(mla.scaling, rel=1e-12) and not cfg.mla.rope
    assert cfg.mla.q_lora_rank == (mla.q_lora_rank or 0) and cfg.mla.kv_lora_rank == mla.kv_lora_rank
    gate = next(x.mlp.gate for x in layers if type(x.mlp).__name__ == "KimiLinearMoE")
    assert (cfg.deepseek_moe.n_group, cfg.deepseek_moe.topk_group) == (gate.num_group, gate.topk_group)
    assert cfg.deepseek_moe.routed_scaling_factor == gate.routed_scaling_factor
    assert cfg.norm_topk_prob == gate.norm_topk_prob and cfg.num_experts_per_tok == gate.top_k
    assert cfg.num_experts == gate.num_experts
    assert float(gate.e_score_correction_bias.abs().max()) > 0.01  # random: selection != scoring


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gdn", ["auto", pytest.param("chunked", marks=pytest.mark.slow)])
def test_logits_match_hf(ours, hf, family, gdn):
    """Every CPU KDA path ("auto" is "reference", the per-token loop; "chunked" under -m slow)
    through state slots and MLA latent pages (the native MLA path)."""
    from models.kda_layer import kda_impl

    assert kda_impl(KernelOptions(gdn="auto")) == "reference"
    model = ours(family)
    for n in AUTO_LENGTHS if gdn == "auto" else LENGTHS:
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        got = model.logits(ids, KernelOptions(gdn=gdn))
        err = np.abs(got - hf_logits(hf(family), ids)).max()
        assert err <= 1e-4, f"{family} gdn={gdn} T={n}: max abs logit error {err:.2e}"


@pytest.fixture(scope="module")
def gpu_shaped(tmp_path_factory):
    """A third tiny checkpoint whose KDA head dim is what the Triton kernel takes (a power of two
    >= 16): `kimi_linear` with 2 KDA heads of 16."""
    from transformers import AutoModelForCausalLM

    from models.random_checkpoint import write_random_checkpoint

    lac = dict(kda_layers=[1, 2, 4, 5], full_attn_layers=[3], head_dim=16, num_heads=2, short_conv_kernel_size=4)
    path = write_random_checkpoint(
        "kimi_linear", tmp_path_factory.mktemp("kimi_gpu_shaped"), seed=1, linear_attn_config=lac
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return load_model(path, dtype="float32"), hf


@pytest.mark.slow
def test_logits_match_hf_through_the_tpu_kernels_interpreted(ours, hf):
    """The Pallas TPU KDA and MLA kernels (interpret mode) inside the model."""
    opts = KernelOptions(attention="pallas_tpu", gdn="pallas_tpu", interpret=True)
    for n in (1, 70):
        ids = random_prompt(ours("kimi_linear").cfg.vocab_size, n, seed=n)
        err = np.abs(ours("kimi_linear").logits(ids, opts) - hf_logits(hf("kimi_linear"), ids)).max()
        assert err <= 1e-4, f"pallas_tpu T={n}: max abs logit error {err:.2e}"


@pytest.mark.slow
def test_logits_match_hf_through_the_gpu_kda_kernel(gpu_shaped):
    """The Pallas GPU KDA kernel (interpreted on CPU, compiled on a GPU). (The GPU MLA kernel needs
    rows of a multiple of 16 channels, not these 28: MLA runs the reference here.)"""
    model, hf = gpu_shaped
    assert model.cfg.linear_key_head_dim == 16
    opts = KernelOptions(attention="reference", gdn="pallas_gpu", interpret=gpu_kernel_interpret())
    for n in (1, 70):
        ids = random_prompt(model.cfg.vocab_size, n, seed=n)
        err = np.abs(model.logits(ids, opts) - hf_logits(hf, ids)).max()
        assert err <= 1e-4, f"pallas_gpu T={n}: max abs logit error {err:.2e}"


@pytest.mark.slow
def test_logits_match_hf_unrolled(tiny_checkpoint, hf):
    """The unrolled layer loop (the CPU plan's) on the scanned checkpoint's two groups."""
    model = load_model(tiny_checkpoint("kimi_linear_qlora"), dtype="float32")
    assert model.num_groups == 2
    model.unstack_layers()
    ids = random_prompt(model.cfg.vocab_size, 40, seed=40)
    err = np.abs(model.logits(ids) - hf_logits(hf("kimi_linear_qlora"), ids)).max()
    assert err <= 1e-4, err


def _with(params: dict, name: str, fn) -> dict:
    groups = tuple({**g, name: fn(g[name])} if name in g else g for g in params["groups"])
    return {**params, "groups": groups}


def _per_head_mean(dt_bias, cfg):
    """dt_bias [G, H*K] with each head's K channels replaced by their mean: one decay per head."""
    x = dt_bias.reshape(dt_bias.shape[0], -1, cfg.linear_key_head_dim)
    return jax.numpy.broadcast_to(x.mean(-1, keepdims=True), x.shape).reshape(dt_bias.shape)


@pytest.mark.slow
def test_each_feature_moves_the_logits_beyond_the_tolerance(ours, hf):
    """Leaving out any Kimi feature would fail `test_logits_match_hf` by orders of magnitude."""
    base = ours("kimi_linear")
    ids = random_prompt(base.cfg.vocab_size, 70, seed=70)
    expected = hf_logits(hf("kimi_linear"), ids)
    cfg, params = base.cfg, base.params
    variants = {
        "MLA with RoPE": (dict(mla=dataclasses.replace(cfg.mla, rope=True)), params),
        "softmax scale of qk_nope alone": (dict(mla=dataclasses.replace(cfg.mla, softmax_scale=12**-0.5)), params),
        "no routed scaling": (
            dict(deepseek_moe=dataclasses.replace(cfg.deepseek_moe, routed_scaling_factor=1.0)),
            params,
        ),
        "no expert groups": (dict(deepseek_moe=dataclasses.replace(cfg.deepseek_moe, n_group=1, topk_group=1)), params),
        "no correction bias": ({}, _with(params, "e_score_bias", lambda b: 0 * b)),
        "one decay per head (GDN's)": ({}, _with(params, "dt_bias", lambda b: _per_head_mean(b, cfg))),
        "a constant output gate": ({}, _with(params, "g_b", lambda w: 0 * w)),
        "no short conv": ({}, _with(params, "conv_w", lambda w: jax.numpy.zeros_like(w).at[..., -1].set(1.0))),
    }
    for what, (change, p) in variants.items():
        variant = Model(dataclasses.replace(cfg, **change), p, "float32", base.path)
        err = np.abs(variant.logits(ids) - expected).max()
        assert err > 1e-2, f"{what}: logits moved only {err:.2e}"


@pytest.mark.slow  # the engine test below decodes through the same slots and pages
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(ours, hf, family):
    """Decoding one token at a time: KDA's recurrent step from the slot (HF's recurrent path) and
    MLA over the latent pages, across pages of 16."""
    ids = random_prompt(ours(family).cfg.vocab_size, 30, seed=130)
    expected, scores = hf_greedy(hf(family), ids, 20)
    assert_greedy_match(ours(family).greedy(ids, 20), expected, scores, f"{family} prompt 30")


@pytest.mark.slow
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(tiny_checkpoint, hf):
    """bf16 weights (router, A_log, dt_bias and the KDA state in float32, as HF keeps them): our
    logits are as close to HF's float32 ones as HF's own bfloat16 model's are (within 2x)."""
    assert_bf16_as_close_as_hf_bf16(
        tiny_checkpoint("kimi_linear"), hf("kimi_linear"), "stacked", attn_implementation="eager"
    )


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """One engine for the engine tests: 16-token steps (chunked prefill), prefix caching, and a
    pool of 28 pages of 8 that four 50-80-token requests generating 30 each overflow (preemption)."""
    from runtime.engine.llm_engine import LLMEngine

    config = small_engine_config(
        tiny_checkpoint("kimi_linear"),
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
    the conv and KDA states the last one left in the slot), with decodes riding along."""
    vocab = engine.model.cfg.vocab_size
    prompts = {f"c{i}": random_prompt(vocab, n, seed=500 + i) for i, n in enumerate((5, 41, 19, 66))}
    done = _run(engine, prompts, 10)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf("kimi_linear"), ids, 10)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")
    _assert_nothing_leaked(engine)


def test_engine_prefix_hits_and_preemption_match_hf(engine, hf):
    """A chat continuation resumes from its predecessor's KDA state checkpoint and a shared 30-token
    prefix from a divergence checkpoint (with the MLA latent pages of both); then four 50-80-token
    requests generating 30 tokens each overflow the 28-page pool and preempt each other. Every
    output is HF's greedy one, and every page and state slot comes back."""
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
        expected, scores = hf_greedy(hf("kimi_linear"), ids, lengths[rid])
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"engine {rid} ({len(ids)} tokens)")


@contextlib.contextmanager
def hf_fp8_rows(model, page_size: int, dtype=torch.float8_e4m3fn):
    """HF's model with each MLA layer's rows [kv_a_layernorm(c) | k_rot] rounded to FP8 as pages of
    `page_size` written in one prefill hold them: one scale per page, amax / fmax, clipped. k_rot
    is a view of kv_a_proj_with_mqa's output (HF splits it), rounded there in place; the normed
    latent is replaced by the layer norm's hook. No cache: for full-sequence logits."""
    limit = torch.finfo(dtype).max
    latest, hooks = {}, []
    for layer in model.model.layers:
        attn = layer.self_attn
        if not hasattr(attn, "kv_a_layernorm"):  # a KDA layer
            continue

        def round_rows(module, inputs, c, L=attn.kv_lora_rank):
            kv = latest["kv"]  # [1, S, L + R]
            rows = torch.cat([c[0], kv[0, :, L:]], dim=-1)
            out = torch.empty_like(rows)
            for s in range(0, rows.shape[0], page_size):
                scale = torch.tensor(max(float(rows[s : s + page_size].abs().max()) / limit, 1e-30))
                out[s : s + page_size] = (rows[s : s + page_size] / scale).clamp(-limit, limit).to(
                    dtype
                ).float() * scale
            kv[0, :, L:] = out[:, L:]
            return out[None, :, :L]

        hooks.append(attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, out: latest.update(kv=out)))
        hooks.append(attn.kv_a_layernorm.register_forward_hook(round_rows))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.slow
def test_fp8_latent_pages(ours, hf):
    """FP8 (e4m3) latent rows with one scale per page, NoPE key channels included: the logits equal
    HF's with its rows rounded to FP8 the same way (within 1e-4; FP8 itself moves them by ~0.4)."""
    model, reference = ours("kimi_linear"), hf("kimi_linear")
    ids = random_prompt(model.cfg.vocab_size, 70, seed=71)
    with hf_fp8_rows(reference, page_size=16):
        expected = hf_logits(reference, ids)
    got = model.logits(ids, kv_dtype="fp8_e4m3", page_size=16)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(got - hf_logits(reference, ids)).max() > 1e-2  # the rows really were FP8


def test_state_and_kv_bytes_from_the_config(ours, tiny_checkpoint):
    """The engine's accounting read off config.json by hand: a state slot holds, per KDA layer, the
    conv state (W-1) x 3HK and the recurrent state H x K x K (fp32); a token's KV is one MLA row of
    kv_lora_rank + qk_rope_head_dim per MLA layer."""
    hf_cfg = read_json(tiny_checkpoint("kimi_linear") / "config.json")
    lac = hf_cfg["linear_attn_config"]
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    per_layer = (W - 1) * 3 * H * K + H * K * K
    model = ours("kimi_linear")
    assert model.state_bytes_per_slot() == 4 * per_layer * len(lac["kda_layers"])
    row = hf_cfg["kv_lora_rank"] + hf_cfg["qk_rope_head_dim"]
    assert model.cache_bytes_per_token("bfloat16") == 2 * row * len(lac["full_attn_layers"])


def _hf_names(tensors: dict) -> dict:
    """Moonshot's tensor names -> transformers' in-memory ones: `mlp.`, fused experts, one conv,
    the gate under `forget_gate.`."""
    out = {}
    for name, value in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for leaf in ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias"):
            name = name.replace(f"self_attn.{leaf}", f"self_attn.forget_gate.{leaf}")
        out[name] = value
    for key in [k for k in out if k.endswith("q_conv1d.weight")]:
        a = key[: -len("q_conv1d.weight")]
        out[a + "conv1d.weight"] = torch.cat([out.pop(a + f"{n}_conv1d.weight") for n in "qkv"])
    for key in [k for k in out if k.endswith("experts.0.w1.weight")]:
        m = key[: -len("0.w1.weight")]
        n = len([k for k in out if k.startswith(m) and k.endswith(".w1.weight")])
        gate_up = [torch.cat([out.pop(f"{m}{e}.w1.weight"), out.pop(f"{m}{e}.w3.weight")]) for e in range(n)]
        out[m + "gate_up_proj"] = torch.stack(gate_up)
        out[m + "down_proj"] = torch.stack([out.pop(f"{m}{e}.w2.weight") for e in range(n)])
    return out


@pytest.mark.slow
def test_transformers_in_memory_names_load_the_same(ours, tiny_checkpoint, tmp_path):
    """The same weights under transformers' in-memory names (fused experts, one conv, `mlp.`,
    `forget_gate.`) load to the same logits."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("kimi_linear")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(_hf_names(load_file(src / "model.safetensors")), tmp_path / "model.safetensors")
    ids = random_prompt(1031, 23, seed=23)
    np.testing.assert_array_equal(load_model(tmp_path, dtype="float32").logits(ids), ours("kimi_linear").logits(ids))


def test_shipped_kimi_linear_48b_config():
    """configs/models/kimi-linear-48b-a3b.json, Moonshot's published config.json: 27 layers, KDA
    at 20 of them and NoPE MLA at 7, the first dense, 256 experts top-8 in one group, 32 KDA heads
    of 128; HF's KimiLinearConfig reads the same file the same way; about 48B parameters."""
    from transformers import KimiLinearConfig

    published = read_json(CONFIG_DIR / "models" / "kimi-linear-48b-a3b.json")
    cfg = parse_config(published)
    hf_cfg = KimiLinearConfig(**published)
    assert cfg.architecture == "KimiLinearForCausalLM" and cfg.num_layers == 27
    assert cfg.layer_types == tuple(hf_cfg.layer_types)
    assert cfg.layer_types.count(ATTENTION) == 7 and cfg.layer_types.count(LINEAR) == 20
    assert cfg.mlp_types == tuple("moe" if t == "sparse" else t for t in hf_cfg.mlp_layer_types)
    assert cfg.mlp_types == ("dense",) + ("moe",) * 26
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf_cfg.num_local_experts, hf_cfg.num_experts_per_tok)
    assert (cfg.deepseek_moe.n_group, cfg.deepseek_moe.topk_group) == (hf_cfg.n_group, hf_cfg.topk_group)
    assert cfg.deepseek_moe.routed_scaling_factor == hf_cfg.routed_scaling_factor
    assert (cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (hf_cfg.linear_num_heads, hf_cfg.linear_head_dim)
    assert cfg.linear_conv_kernel_dim == hf_cfg.linear_conv_kernel_dim
    assert cfg.mla.latent_width == 576 and cfg.mla.q_lora_rank == 0 and not cfg.mla.rope
    assert cfg.max_position_embeddings == hf_cfg.max_position_embeddings
    count = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    assert abs(count / 48e9 - 1) < 0.05, count


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_expert_group=3), "n_group"),
        (dict(num_experts_per_token=7), "num_experts_per_tok"),
        (dict(layer_types=None, linear_attn_config=dict(kda_layers=[1, 2], full_attn_layers=[3])), "layers \\[4, 5\\]"),
    ],
)
def test_unsupported_options_are_refused_at_load(tiny_checkpoint, tmp_path, change, match):
    src = tiny_checkpoint("kimi_linear")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    hf_cfg = read_json(tmp_path / "config.json")
    hf_cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(ConfigError, match=match):
        load_model(tmp_path)
