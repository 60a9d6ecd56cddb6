"""Kimi Linear with narrower storage, against HF transformers on the tiny `kimi_linear` checkpoint:
KDA state slots in bfloat16 (`cache.state_dtype`) and online int8 weights (`quantization: int8`).
The bf16 engine test is `-m slow` (tests/test_kda_kernel.py checks bf16 slots per KDA
implementation in the default run); tests/test_kimi_linear.py holds the float32 model.
"""

from __future__ import annotations

import re
import shutil

import jax
import numpy as np
import pytest
import torch
from engine_testing import drain, small_engine_config
from hf_reference import assert_greedy_match, hf_greedy, hf_logits, random_prompt

from models import load_model
from models.quant_rules import QuantizationConfig
from models.safetensors_io import read_json


def _hf(path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return _hf(tiny_checkpoint("kimi_linear"))


@pytest.mark.slow  # an engine of its own (~25 s on a loaded 2-core host)
def test_engine_with_bf16_state_agrees_with_hf(tiny_checkpoint, hf):
    """`cache.state_dtype` bfloat16: the KDA conv and recurrent slots in bf16 (2 bytes per value,
    read off config.json by hand), the recurrence in f32; a 41-token prompt prefilled in 16-token
    chunks (each chunk resuming from the bf16 slot) and a short one, decoding 10 tokens: HF's fp32
    greedy tokens, with the GDN bf16-state test's tolerance (a first divergence only at a near tie)."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint("kimi_linear")
    config = small_engine_config(path, state_dtype="bfloat16", max_num_batched_tokens=16, load_tokenizer=False)
    engine = LLMEngine(config)
    states = [a for a in (*engine.caches["conv"], *engine.caches["rec"]) if a is not None]
    assert states and all(a.dtype == jax.numpy.bfloat16 for a in states)
    lac = read_json(path / "config.json")["linear_attn_config"]
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    assert engine.model.state_bytes_per_slot() == 2 * ((W - 1) * 3 * H * K + H * K * K) * len(lac["kda_layers"])
    prompts = {f"b{i}": random_prompt(engine.model.cfg.vocab_size, n, seed=700 + i) for i, n in enumerate((41, 9))}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, params))
    done = drain(engine)
    for rid, ids in prompts.items():
        expected, scores = hf_greedy(hf, ids, 10)
        assert_greedy_match(done[rid].outputs[0].token_ids, expected, scores, f"bf16 state {rid} ({len(ids)} tokens)")


# HF tensors (Moonshot's names) the default int8 rules quantize: KDA's and MLA's q/k/v/o projections,
# the dense and shared MLPs, the routed experts. Float: the gates' low-rank f_a/f_b/g_a/g_b, b_proj,
# MLA's latent kv_a / kv_b, the router, the embedding and lm_head (models/quant_rules.py).
INT8_TENSORS = re.compile(
    r"self_attn\.([qkvo]|q_a|q_b|kv_a|kv_b|g_a|g_b)_proj(_with_mqa)?\.weight$|block_sparse_moe\.(gate|up|down)_proj\.weight$"
    r"|experts\.\d+\.w[123]\.weight$|shared_experts\.(gate|up|down)_proj\.weight$"
)


def _int8_rounded(w: np.ndarray) -> np.ndarray:
    """w [out, in] rounded to int8 per output row (amax / 127, round to nearest), back in float32."""
    w = w.astype(np.float64)
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    return (np.clip(np.round(w / scale), -127, 127) * scale).astype(np.float32)


def test_online_int8_matches_hf_with_the_same_rounded_weights(tiny_checkpoint, hf, tmp_path):
    """`quantization: int8`, online at load: our logits equal HF's model whose weights were rounded
    to int8 per output channel by hand (numpy, on HF's tensors) within 1e-4, while int8 moves the
    logits far beyond that from the float model's."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint("kimi_linear")
    tensors = load_file(src / "model.safetensors")
    rounded = {k: _int8_rounded(v) if INT8_TENSORS.search(k) else v for k, v in tensors.items()}
    names = [k for k in tensors if INT8_TENSORS.search(k)]
    assert len(names) > 50 and any(".q_proj." in k for k in names) and any(".w2." in k for k in names)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(rounded, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = random_prompt(1031, 40, seed=41)
    expected = hf_logits(_hf(tmp_path), ids)
    got = load_model(src, dtype="float32", quantization=QuantizationConfig("int8")).logits(ids)
    err = np.abs(got - expected).max()
    assert err <= 1e-4, f"max abs logit error {err:.2e}"
    assert np.abs(got - hf_logits(hf, ids)).max() > 1e-2  # the weights really were int8
