"""Our JAX models against HF transformers' PyTorch models on the same tiny fp32 checkpoints.

Logits are compared at GDN chunk boundaries (1, 63, 64, 65 and > 200 tokens); greedy decoding
through the paged caches (prefill, then one token per step) is compared with HF `generate`,
accepting a divergence only where HF's top-2 logit gap is below 1e-3.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import assert_greedy_match, hf_greedy

from models import load_model
from models.random_checkpoint import FAMILIES

LENGTHS = (1, 63, 64, 65, 203)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(family, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(family)
    ours = load_model(path, dtype="float32")
    hf = hf_model(family)
    for n in LENGTHS:
        ids = _prompt(ours.cfg.vocab_size, n, seed=n)
        expected = _hf_logits(hf, ids)
        got = ours.logits(ids)
        assert got.shape == expected.shape
        err = np.abs(got - expected).max()
        assert err <= 1e-4, f"{family} T={n}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family, tiny_checkpoint, hf_model):
    path = tiny_checkpoint(family)
    ours = load_model(path, dtype="float32")
    hf = hf_model(family)
    for n in (70,):  # crosses a GDN chunk and several pages; the engine tests cover many more lengths
        ids = _prompt(ours.cfg.vocab_size, n, seed=100 + n)
        expected, scores = hf_greedy(hf, ids, 24)
        got = ours.greedy(ids, 24)
        assert_greedy_match(got, expected, scores, f"{family} prompt {n}")


def _assert_as_close_as_hf_bf16(ours, path, hf_fp32, what: str) -> None:
    """Our bf16 logits are as close to HF's float32 ones as HF's own bfloat16 model's are (within
    2x), at a decode-sized (1) and a prefill-sized (65, padded to a bucket) row count."""
    from transformers import AutoModelForCausalLM

    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for n in (1, 65):
        ids = _prompt(ours.cfg.vocab_size, n, seed=300 + n)
        reference = _hf_logits(hf_fp32, ids)
        ours_err = np.abs(np.asarray(ours.logits(ids), np.float32) - reference).max()
        hf_err = np.abs(_hf_logits(hf_bf16, ids) - reference).max()
        assert hf_err > 0 and ours_err <= 2 * hf_err, f"{what} T={n}: ours {ours_err:.3e} vs HF bf16 {hf_err:.3e}"


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_bf16_logits_as_close_to_fp32_as_hf_bf16(family, tiny_checkpoint, hf_model):
    """bf16 weights (CPU's fast serving dtype, runtime/steps/execution_plan.py): our logits are as close to HF's
    float32 logits as HF's own bfloat16 model is (bf16 rounding, not a wrong op, is the difference)."""
    path = tiny_checkpoint(family)
    ours = load_model(path, dtype="bfloat16")
    _assert_as_close_as_hf_bf16(ours, path, hf_model(family), family)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_packed_bf16_logits_as_close_to_fp32_as_hf_bf16(family, tiny_checkpoint, hf_model):
    """The CPU plan's bf16 layout (`Model.hold_packed`: projections, and a tied embedding's logits
    copy, packed for the native matmul): the same bound against HF's float32 logits as above, at a
    decode-sized and a prefill-sized row count."""
    from models.quantization import PackedWeight
    from pallas_kernels import cpu_native

    if not cpu_native.matmul_simd():
        pytest.skip("this CPU has no AVX512-BF16: the plan keeps XLA's dot")
    path = tiny_checkpoint(family)
    ours = load_model(path, dtype="bfloat16")
    ours.unstack_layers()
    ours.hold_packed()
    layer = ours.params["layers"][0]
    assert any(
        isinstance(w, PackedWeight) for w in jax.tree.leaves(layer, is_leaf=lambda w: isinstance(w, PackedWeight))
    )
    assert ("head_packed" in ours.params) == ("lm_head" not in ours.params)
    _assert_as_close_as_hf_bf16(ours, path, hf_model(family), family)


def _serve_bf16_packed(path, prompts: dict) -> dict:
    from engine_testing import drain

    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(path),
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_pages=64,
            max_model_len=256,
            load_tokenizer=False,
            enable_prefix_caching=False,
        )
    )
    assert engine.plan.weight_layout == "packed" and len(engine.token_buckets) > 2
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    return {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_engine_bf16_packed_skips_padding_rows_exactly(family, tiny_checkpoint, monkeypatch):
    """The CPU plan's bf16 serving path end to end: packed projections whose native matmul skips
    each step's bucket padding rows (`ForwardBatch.num_valid_rows`, passed to every projection),
    chunked prefill across several
    token buckets with decodes riding along. Llama: every request's greedy tokens against HF's
    bfloat16 model, equal or diverging first where HF's top-2 gap is within bf16 noise (< 2^-5;
    the hybrid's bf16 GDN rounds differently from HF's, so its bf16 tokens are checked at the
    logit level in the test above). Both: every native matmul over the step's token rows got that
    count, and the same tokens come out with the skipping turned off (every padding row computed)."""
    from transformers import AutoModelForCausalLM

    from pallas_kernels import cpu_native

    if not cpu_native.matmul_simd():
        pytest.skip("this CPU has no AVX512-BF16: the plan keeps XLA's dot")
    path = tiny_checkpoint(family)
    vocab = load_model(path).cfg.vocab_size
    prompts = {f"r{i}": _prompt(vocab, n, seed=400 + i) for i, n in enumerate((3, 45, 17, 9, 26))}
    matmul, seen = cpu_native.bf16_matmul, []

    def spy(x, wp, n, out_dtype=jnp.bfloat16, valid_rows=None):  # runs while a step is traced
        head = any(frame.name == "compute_logits" for frame in traceback.extract_stack())
        seen.append(("head" if head else "layers", valid_rows is not None))
        return matmul(x, wp, n, out_dtype, valid_rows)

    monkeypatch.setattr(cpu_native, "bf16_matmul", spy)
    got = _serve_bf16_packed(path, prompts)
    # every projection of the layers skips the padding rows; the logits head computes its R rows
    assert set(seen) == {("layers", True), ("head", False)}
    if family == "llama":
        hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        for rid, ids in prompts.items():
            expected, scores = hf_greedy(hf_bf16, ids, 8)
            for i, (a, b) in enumerate(zip(got[rid], expected)):
                if a != b:
                    gap = np.diff(np.sort(scores[i])[-2:])[0]
                    assert gap < 2**-5, f"{rid}: token {i} is {a}, HF bf16 gives {b} (top-2 gap {gap:.2e})"
                    break
            else:
                assert len(got[rid]) == len(expected) == 8
    monkeypatch.setattr(
        cpu_native, "bf16_matmul", lambda x, wp, n, out_dtype=jnp.bfloat16, valid_rows=None: matmul(x, wp, n, out_dtype)
    )
    assert _serve_bf16_packed(path, prompts) == got
