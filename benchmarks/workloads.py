"""Reproducible benchmark request sets, as data: token-id prompts and output lengths from a seed.

    reqs = make_workload("mixed", vocab_size=49152, seed=0, scale=0.25, max_model_len=2048)
    reqs[0].prompt_ids, reqs[0].max_tokens

Prompts are token ids (not text), drawn from the vocabulary above its special-token region, so
every checkpoint (tiny random ones included) and every OpenAI-compatible server (which accepts
`prompt: [ids]`) sees exactly the same tokens. Output lengths are exact: clients send
`ignore_eos` so each request generates `max_tokens` tokens.

Workloads (lengths before `scale`):
  fixed          prompt 128, output 128
  mixed          prompt 16-1024 and output 16-256, log-normal (long-tailed), clipped
  shared_prefix  one system prompt of min(2048, max_model_len/2) tokens + user turns of 16-64
                 tokens, output 32; the prefix-caching workload
  long_context   prompts of max_model_len - output - (0..15), output 16
`scale` multiplies every length (never below 1) so CPU runs stay short; `max_model_len` caps
prompt + output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

WORKLOADS = ("fixed", "mixed", "shared_prefix", "long_context")
DEFAULT_NUM_REQUESTS = {"fixed": 32, "mixed": 64, "shared_prefix": 32, "long_context": 8}


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) ids to draw prompt tokens from: skips the low ids where special tokens live."""
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be >= 8, got {vocab_size}")
    return min(1000, vocab_size // 4), vocab_size


def _scaled(n: float, scale: float) -> int:
    return max(1, round(n * scale))


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    low, high = token_id_range(vocab_size)
    return tuple(int(t) for t in rng.integers(low, high, size=n))


def _long_tailed(rng: np.random.Generator, n: int, low: int, high: int, median: float) -> np.ndarray:
    """Log-normal lengths with the given median, clipped to [low, high]."""
    draws = rng.lognormal(mean=np.log(median), sigma=0.8, size=n)
    return np.clip(np.round(draws), low, high).astype(int)


def make_workload(
    name: str,
    *,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    scale: float = 1.0,
    max_model_len: int = 2048,
) -> list[BenchRequest]:
    """The `name` workload: a list of requests, identical for identical arguments."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    n = DEFAULT_NUM_REQUESTS[name] if num_requests is None else num_requests
    # One stream per workload name: changing one workload's recipe never shifts another's.
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    rng = np.random.default_rng([seed, name_key])

    def capped(prompt_len: int, out_len: int) -> tuple[int, int]:
        out_len = min(out_len, max_model_len - 1)
        return max(1, min(prompt_len, max_model_len - out_len)), out_len

    requests = []
    if name == "fixed":
        for _ in range(n):
            p, o = capped(_scaled(128, scale), _scaled(128, scale))
            requests.append(BenchRequest(_random_ids(rng, p, vocab_size), o))
    elif name == "mixed":
        p_lo, p_hi = _scaled(16, scale), _scaled(1024, scale)
        o_lo, o_hi = _scaled(16, scale), _scaled(256, scale)
        prompt_lens = _long_tailed(rng, n, p_lo, p_hi, median=_scaled(160, scale))
        output_lens = _long_tailed(rng, n, o_lo, o_hi, median=_scaled(64, scale))
        for p, o in zip(prompt_lens, output_lens):
            p, o = capped(int(p), int(o))
            requests.append(BenchRequest(_random_ids(rng, p, vocab_size), o))
    elif name == "shared_prefix":
        out_len = _scaled(32, scale)
        system = _random_ids(rng, _scaled(min(2048, max_model_len // 2), scale), vocab_size)
        for user_len in rng.integers(_scaled(16, scale), _scaled(64, scale) + 1, size=n):
            p, o = capped(len(system) + int(user_len), out_len)
            ids = (system + _random_ids(rng, int(user_len), vocab_size))[:p]
            requests.append(BenchRequest(ids, o))
    else:  # long_context
        out_len = _scaled(16, scale)
        for jitter in rng.integers(0, 16, size=n):
            p, o = capped(max_model_len - out_len - int(jitter), out_len)
            requests.append(BenchRequest(_random_ids(rng, p, vocab_size), o))
    return requests


def make_uniform(n: int, prompt_len: int, output_len: int, *, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """n requests of exactly `prompt_len` random prompt tokens and `output_len` output tokens."""
    rng = np.random.default_rng([seed, prompt_len, output_len])
    return [BenchRequest(_random_ids(rng, prompt_len, vocab_size), output_len) for _ in range(n)]


def shared_prefix_len(requests: list[BenchRequest]) -> int:
    """Length of the prefix every request shares (0 if they share none)."""
    if not requests:
        return 0
    first = requests[0].prompt_ids
    n = len(first)
    for r in requests[1:]:
        m = 0
        while m < min(n, r.prompt_len) and r.prompt_ids[m] == first[m]:
            m += 1
        n = m
    return n


def summarize(requests: list[BenchRequest]) -> dict:
    """Counts and a content fingerprint, written next to every result so runs can be matched."""
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.max_tokens for r in requests]
    digest = hashlib.sha256(json.dumps([[list(r.prompt_ids), r.max_tokens] for r in requests]).encode())
    return {
        "num_requests": len(requests),
        "prompt_tokens": int(sum(prompt_lens)),
        "output_tokens": int(sum(output_lens)),
        "prompt_len_min_mean_max": [
            min(prompt_lens, default=0),
            float(np.mean(prompt_lens or [0])),
            max(prompt_lens, default=0),
        ],
        "output_len_min_mean_max": [
            min(output_lens, default=0),
            float(np.mean(output_lens or [0])),
            max(output_lens, default=0),
        ],
        "sha256": digest.hexdigest()[:16],
    }
