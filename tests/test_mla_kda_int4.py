"""int4 weights (`quantization: int4`: zero-point groups of 32 along the input dim) on MLA and KDA,
against HF transformers running the same weights rounded to int4 by hand (numpy, on HF's tensors).

Two tiny checkpoints whose every quantized projection has an input dim that is a multiple of 32
(so every one takes groups of 32, none falls back to a smaller group or float): a DeepSeek-V3
(q LoRA 32, latent 32, 4 heads x 16) and a Kimi Linear (KDA heads of 32 channels, NoPE MLA with a
latent of 32). The float32 logits equal HF's on the rounded weights within 1e-4 (while int4 moves
them far beyond that from the float model's), and greedy decoding through the paged caches gives
HF's greedy tokens on the rounded weights (near-tie rule). MLA's kv_b_proj is dequantized in the
step (absorbed: models/mla_attention.py `absorbed_weight`), the other projections run quantized.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from models import load_model
from models.quant_rules import QuantizationConfig
from models.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.slow  # two checkpoints built and two HF models each (~2.5 min on the loaded 2-core host)

_DIMS = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4
)
CHECKPOINTS = {
    "deepseek_v3": dict(_DIMS, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "kimi_linear": dict(
        _DIMS,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config=dict(
            kda_layers=[1, 2, 4, 5], full_attn_layers=[3], head_dim=32, num_heads=2, short_conv_kernel_size=4
        ),
    ),
}
# HF tensors the default int4 rules quantize (models/quant_rules.py): attention's and KDA's projections
# but KDA's decay gate (f_a / f_b) and beta (b_proj), the MLPs (Kimi's dense one is `block_sparse_moe.*_proj`)
# and experts; float: router, embedding, lm_head
INT4_TENSORS = re.compile(
    r"self_attn\.([qkvo]|q_a|q_b|kv_a|kv_b|g_a|g_b)_proj(_with_mqa)?\.weight$"
    r"|(mlp|block_sparse_moe)\.(gate|up|down)_proj\.weight$|experts\.\d+\.(gate|up|down)_proj\.weight$|experts\.\d+\.w[123]\.weight$"
    r"|shared_experts\.(gate|up|down)_proj\.weight$|experts\.(gate_up|down)_proj$"
)


def _int4_rounded(w: np.ndarray, group: int = 32) -> np.ndarray:
    """w [out, in] (or [E, out, in]) rounded to 4-bit codes 0..15 with a zero point per group of
    `group` input channels: lo + round((w - lo) / s) * s, s = (hi - lo) / 15, in float32."""
    w = np.asarray(w, np.float32)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = np.maximum(hi - lo, np.float32(1e-12)) / np.float32(15.0)
    codes = np.clip(np.round((g - lo) / scale), 0, 15)
    return (codes * scale + lo).reshape(w.shape).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (float checkpoint, the same with INT4_TENSORS rounded by hand)."""
    from safetensors.numpy import load_file, save_file

    out = {}
    for family, dims in CHECKPOINTS.items():
        src = write_random_checkpoint(family, tmp_path_factory.mktemp(family), **dims)
        tensors = load_file(src / "model.safetensors")
        names = [k for k in tensors if INT4_TENSORS.search(k)]
        assert all(tensors[k].shape[-1] % 32 == 0 for k in names), [(k, tensors[k].shape) for k in names]
        rounded_dir = tmp_path_factory.mktemp(family + "_int4")
        shutil.copy(src / "config.json", rounded_dir / "config.json")
        rounded = {k: _int4_rounded(v) if k in names else v for k, v in tensors.items()}
        save_file(rounded, rounded_dir / "model.safetensors", metadata={"format": "pt"})
        out[family] = (src, rounded_dir, names)
    return out


def _hf(path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_int4_matches_hf_with_the_same_rounded_weights(checkpoints, family):
    src, rounded_dir, names = checkpoints[family]
    assert any("kv_b_proj" in k for k in names) and any("o_proj" in k for k in names)
    model = load_model(src, dtype="float32", quantization=QuantizationConfig("int4"))
    got_kinds = {path: what for path, what in model.quantization.items() if not what.startswith("float")}
    assert got_kinds and set(got_kinds.values()) == {"int4-g32"}, model.quantization
    assert "self_attn.kv_b_proj" in got_kinds and "self_attn.o_proj" in got_kinds
    if family == "kimi_linear":
        assert "self_attn.g_b_proj" in got_kinds and model.quantization["self_attn.f_a_proj"].startswith("float")
    hf, hf_float = _hf(rounded_dir), _hf(src)
    ids = random_prompt(model.cfg.vocab_size, 40, seed=43)
    got, expected = model.logits(ids), hf_logits(hf, ids)
    err = np.abs(got - expected).max()
    assert err <= 1e-4, f"max abs logit error {err:.2e}"
    assert np.abs(got - hf_logits(hf_float, ids)).max() > 1e-2  # the weights really were int4
    for n, seed in ((7, 44), (23, 45)):
        prompt = random_prompt(model.cfg.vocab_size, n, seed=seed)
        expected_ids, scores = hf_greedy(hf, prompt, 8)
        assert_greedy_match(model.greedy(prompt, 8), expected_ids, scores, f"{family} int4 greedy ({n} tokens)")
