"""Whole models through the Pallas kernels (interpret mode on CPU) equal the references and HF.

A dense checkpoint (llama: paged attention only) and a hybrid one (qwen3_5: GDN + gated
attention) run greedy decoding through `KernelOptions(attention="pallas", gdn="pallas",
interpret=True)` (the TPU kernels under the Pallas interpreter), through the pure-jnp
references, and through HF transformers (the independent oracle); then a short engine run with
prompts of mixed lengths goes through chunked prefill and batched decode on the kernels.
Interpret mode is slow, so prompts are short and outputs few tokens; the prompts still cross
a page boundary (page size 16) and the GDN chunk length is exercised by the engine prompt of
70 tokens (one full chunk of 64 plus a remainder).
"""

import numpy as np
import pytest
from engine_testing import drain
from hf_reference import assert_greedy_match, hf_greedy

from models import load_model
from models.ops import KernelOptions
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams

PALLAS = KernelOptions(attention="pallas", gdn="pallas", interpret=True)
REFERENCE = KernelOptions(attention="reference", gdn="reference")
NEW_TOKENS = 4


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=length).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_model_through_pallas_matches_reference_and_hf(family, tiny_checkpoint, hf_model):
    model = load_model(tiny_checkpoint(family))
    ids = _prompt(model.cfg.vocab_size, 21, seed=1)

    # Prefill logits: kernels vs references, every position (f32 model, f32 KV pages).
    logits_pallas = model.logits(ids, opts=PALLAS)
    logits_reference = model.logits(ids, opts=REFERENCE)
    np.testing.assert_allclose(logits_pallas, logits_reference, rtol=2e-4, atol=2e-4)

    pallas = model.greedy(ids, NEW_TOKENS, opts=PALLAS)
    reference = model.greedy(ids, NEW_TOKENS, opts=REFERENCE)
    expected, scores = hf_greedy(hf_model(family), ids, NEW_TOKENS)
    assert_greedy_match(reference, expected, scores, f"{family} reference")
    assert_greedy_match(pallas, expected, scores, f"{family} pallas (interpret)")


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_engine_through_pallas_matches_hf(family, tiny_checkpoint, hf_model):
    """Mixed lengths (70, 9, 23) under a 32-token budget: chunked prefill next to decodes."""
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint(family)),
            dtype="float32",
            page_size=16,
            num_pages=32,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            token_buckets=(8, 32),
            max_model_len=128,
            attention_backend="pallas",
            gdn_backend="pallas",
            interpret=True,
            enable_prefix_caching=False,
            load_tokenizer=False,
        )
    )
    vocab = engine.model.cfg.vocab_size
    prompts = [_prompt(vocab, n, seed=10 + i) for i, n in enumerate((70, 9, 23))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    done = {rid: out.token_ids for rid, out in drain(engine).items()}
    stats = engine.stats()
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"], stats

    hf = hf_model(family)
    for i, prompt in enumerate(prompts):
        expected, scores = hf_greedy(hf, prompt, 3)
        assert_greedy_match(done[f"r{i}"], expected, scores, f"engine pallas prompt {i}")
