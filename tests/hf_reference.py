"""HF transformers as the oracle: greedy generation and the near-tie comparison rule."""

import numpy as np
import torch


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """HF `generate` greedy continuation (EOS ignored) and its per-step scores [n, vocab]."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    scores = torch.stack(out.scores)[:, 0].float().numpy()
    return tokens, scores


def assert_greedy_match(got: list[int], expected: list[int], scores: np.ndarray, what: str) -> None:
    """Equal token for token, or diverging first where HF's top-2 gap is a near tie (< 1e-3)."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            top2 = np.sort(scores[i])[-2:]
            gap = top2[1] - top2[0]
            assert gap < 1e-3, f"{what}: token {i} is {a}, HF gives {b} (top-2 gap {gap:.2e})"
            return
    assert len(got) == len(expected), f"{what}: {len(got)} tokens, HF gave {len(expected)}"


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """n token ids in [3, vocab), seeded (3: past the tiny checkpoints' special tokens)."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    """HF's float logits [len(ids), V] for one sequence, no cache."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def assert_bf16_as_close_as_hf_bf16(path, hf, layout: str, **hf_kwargs) -> None:
    """bf16 weights of the checkpoint at `path`, as loaded (`layout` "stacked") or in the CPU plan's
    packed layout (`Model.hold_packed`, "packed"): our logits are as close to HF's float32 model `hf`
    as HF's own bfloat16 model's are (within 2x), at 1 and 65 tokens. `hf_kwargs`: for from_pretrained."""
    import pytest
    from transformers import AutoModelForCausalLM

    from models import load_model
    from pallas_kernels import cpu_native

    if layout == "packed" and not cpu_native.matmul_simd():
        pytest.skip("this CPU has no AVX512-BF16: the plan keeps XLA's dot")
    model = load_model(path, dtype="bfloat16")
    if layout == "packed":
        model.unstack_layers()
        model.hold_packed()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **hf_kwargs).eval()
    for n in (1, 65):
        ids = random_prompt(model.cfg.vocab_size, n, seed=300 + n)
        reference = hf_logits(hf, ids)
        ours_err = np.abs(np.asarray(model.logits(ids), np.float32) - reference).max()
        hf_err = np.abs(hf_logits(hf_bf16, ids) - reference).max()
        assert hf_err > 0 and ours_err <= 2 * hf_err, f"{layout} T={n}: ours {ours_err:.3e} vs HF bf16 {hf_err:.3e}"
