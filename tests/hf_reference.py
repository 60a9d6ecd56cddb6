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
