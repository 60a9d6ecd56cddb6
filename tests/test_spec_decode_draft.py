"""`speculative_config.method: draft_model` (models/draft_model.py): a second, smaller model with
the target's tokenizer drafts k tokens inside the verify step; its KV pages share the target's ids.

Greedy output equals no speculation and HF on a tiny Llama target with (a) its own checkpoint as
the draft (every draft accepted) and (b) a different random tiny Llama (drafts mostly rejected),
under chunked prefill, preemption and prefix hits; a Qwen3.5 (GDN hybrid) target with a tiny Llama
draft equals no speculation; unsupported drafts and combinations are refused at start-up.
"""

from __future__ import annotations

import json
import shutil

import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy
from test_engine_hf import assert_all_free
from test_spec_decode import NUM_TOKENS, PROMPTS, _greedy_requests, assert_drafting_compiles_nothing

K = 3


def _spec(draft_path):
    return {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": K}


def _engine(path, spec, **overrides):
    return spec_engine(path, spec, **{"num_pages": 64, "enable_prefix_caching": True, **overrides})


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """A different random tiny Llama (one layer, another seed), the same tokenizer and vocab."""
    from models.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint("llama", tmp_path_factory.mktemp("draft") / "ckpt", seed=5, num_hidden_layers=1)


# the `other` engine's KV budget: no cache.num_pages, its pages are what this leaves (test_memory_budget...)
BUDGET = 64 * 6144 + 1000


@pytest.fixture(scope="module")
def llama_engines(tiny_checkpoint, other_llama):
    """(target without speculation, drafting with itself, drafting with `other_llama`: its pool sized
    by the memory budget `BUDGET`, not cache.num_pages)."""
    path = tiny_checkpoint("llama")
    other = _engine(path, _spec(other_llama), num_pages=None, kv_cache_memory_bytes=BUDGET)
    return _engine(path, None), _engine(path, _spec(path)), other


def _page_bytes(path, page_size: int) -> int:
    """One float32 page's K and V over every layer, from the checkpoint's config.json."""
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * page_size


def test_memory_budget_holds_target_and_draft(llama_engines, tiny_checkpoint, other_llama):
    """Without cache.num_pages the pool is budget / (target page + draft page): the draft's pools
    (the same page ids) are counted; the engine serves with it (test_other_draft_rejected...)."""
    _, _, other = llama_engines
    target, draft = _page_bytes(tiny_checkpoint("llama"), 4), _page_bytes(other_llama, 4)
    assert (target, draft) == (4096, 2048)  # BUDGET's arithmetic: 64 pages of both
    assert other.cache_config.num_pages == BUDGET // (target + draft) == 64
    import jax

    assert sum(x.nbytes for x in jax.tree.leaves(other.caches["draft"]["kv"])) == 64 * draft


def _hf(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _serve(engine, requests):
    for request in requests:
        engine.add_request(request)
    done = drain(engine)
    assert_all_free(engine)
    return {rid: out.outputs[0] for rid, out in done.items()}


def _counts(engine, before):
    stats = engine.stats()
    keys = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_preemptions")
    return stats, [stats[k] - before[k] for k in keys]


def _check_equal(got, ref):
    assert set(got) == set(ref)
    for rid, out in got.items():
        want = ref[rid]
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        assert len(out.token_ids) == NUM_TOKENS


def _rounds(spec, off):
    """Two rounds of the greedy batch (the second hits the prefix cache): outputs and counters."""
    before = spec.stats()
    got, ref = {}, {}
    for tag in ("g", "h"):
        requests = _greedy_requests(spec.tokenizer, tag)
        got.update(_serve(spec, requests))
        ref.update(_serve(off, requests))
    return got, ref, before


def test_same_checkpoint_draft_all_accepted(llama_engines, hf_model):
    """The target as its own draft: every draft accepted; output equals no speculation and HF
    (chunked prefill, preemption, prefix hits)."""
    off, same, _ = llama_engines
    got, ref, before = _rounds(same, off)
    stats, (drafted, accepted, preempted) = _counts(same, before)
    assert drafted > 0 and accepted == drafted, stats
    assert preempted > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    _check_equal(got, ref)
    hf = hf_model("llama")
    for i, prompt in enumerate(PROMPTS[:3]):
        expected, scores = hf_greedy(hf, same.tokenizer.encode(prompt), NUM_TOKENS)
        assert_greedy_match(got[f"g{i}"].token_ids, expected, scores, f"llama {prompt!r}")


def test_other_draft_rejected_output_unchanged(llama_engines, hf_model, other_llama):
    """A different random Llama drafts: most drafts rejected, output still equals no speculation and
    HF; every sampled draft chain equals HF's greedy continuation with the draft checkpoint."""
    off, _, other = llama_engines
    other.speculator.draft_log = []
    got, ref, before = _rounds(other, off)
    log, other.speculator.draft_log = other.speculator.draft_log, None
    stats, (drafted, accepted, _) = _counts(other, before)
    assert drafted > 0 and accepted < drafted // 2, stats
    _check_equal(got, ref)
    hf = hf_model("llama")
    for i, prompt in enumerate(PROMPTS[:3]):
        expected, scores = hf_greedy(hf, other.tokenizer.encode(prompt), NUM_TOKENS)
        assert_greedy_match(got[f"g{i}"].token_ids, expected, scores, f"llama {prompt!r}")
    # the drafts themselves: the draft model's greedy continuation of each context, per HF
    draft_hf = _hf(other_llama)
    assert len(log) >= 40
    for context, drafts in log[::4][:40]:
        expected, scores = hf_greedy(draft_hf, list(context), len(drafts))
        assert_greedy_match(drafts, expected, scores, f"draft after {len(context)} tokens")


@pytest.mark.slow
def test_hybrid_target_with_llama_draft(tiny_checkpoint, other_llama):
    """A Qwen3.5 (GDN hybrid) target drafted by a tiny Llama with the same vocab: greedy output
    equals no speculation (the target replays its GDN state over the accepted drafts)."""
    path = tiny_checkpoint("qwen3_5")
    spec, off = _engine(path, _spec(other_llama)), _engine(path, None)
    got, ref, before = _rounds(spec, off)
    stats, (drafted, accepted, _) = _counts(spec, before)
    assert drafted > 0 and accepted < drafted, stats
    _check_equal(got, ref)


@pytest.mark.slow
def test_no_compile_after_startup_with_draft_model(tiny_checkpoint, other_llama):
    """Sealed start-up set with a draft model (its K/V absorbed in every step, its k draft steps in
    the verify executables): a mixed workload plus drafting greedy and sampled requests compile nothing."""
    engine = _engine(
        tiny_checkpoint("llama"),
        _spec(other_llama),
        page_size=16,
        num_pages=64,
        max_num_batched_tokens=64,
        token_buckets=(8, 64),
        max_model_len=256,
        aot_compile=True,
        aot_compile_all=True,
    )
    assert_drafting_compiles_nothing(engine)


@pytest.mark.slow
def test_host_tier_carries_the_draft_kv(tiny_checkpoint):
    """The host-memory tier with a draft model: an evicted page's entry holds the draft's K/V too, so
    after host hits the target drafting for itself still has every draft accepted (stale draft K/V
    in a reloaded page would reject them), and the chat equals caching off without speculation."""
    import numpy as np

    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint("llama")
    small = dict(page_size=8, num_pages=14, max_num_seqs=2, max_model_len=64)  # 13 pages: evictions
    tiered = _engine(path, _spec(path), kv_offloading_size=0.01, **small)
    off = _engine(path, None, enable_prefix_caching=False, **small)
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(3, tiered.model.cfg.vocab_size, size=n).tolist()
    system = draw(16)
    convs = {f"c{i}": system + draw(10) for i in range(5)}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = tiered.stats()
    for turn in range(3):
        wave = [EngineRequest(f"{cid}t{turn}", prompt, params) for cid, prompt in convs.items()]
        got, ref = _serve(tiered, wave), _serve(off, wave)
        for request in wave:
            out = got[request.request_id]
            assert out.token_ids == ref[request.request_id].token_ids, request.request_id
            cid = request.request_id[:2]
            convs[cid] = convs[cid] + out.token_ids + draw(5)
    stats, (drafted, accepted, _) = _counts(tiered, before)
    assert stats["host_cache_pages_loaded"] > 0 and stats["host_cache_hits"] > 0, stats
    assert drafted > 0 and accepted == drafted, stats


# ---- refusals -----------------------------------------------------------------------------------
def test_refusals(tiny_checkpoint, tmp_path):
    """Start-up refusals, by name: another vocab size, a recurrent (GDN) draft, draft TP, the host tier."""
    llama = tiny_checkpoint("llama")
    wide = tmp_path / "wide"
    shutil.copytree(llama, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(
        json.dumps({**config, "vocab_size": config["vocab_size"] + 1})
    )  # before its weights
    with pytest.raises(ValueError, match=r"speculative_config: the draft model's vocab_size \(\d+"):
        _engine(llama, _spec(wide))
    with pytest.raises(ValueError, match="must be attention-only"):
        _engine(llama, _spec(tiny_checkpoint("qwen3_5")))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size: not supported yet"):
        _engine(llama, {**_spec(llama), "draft_tensor_parallel_size": 2})
