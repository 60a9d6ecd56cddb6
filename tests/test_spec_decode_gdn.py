"""Speculative decoding on GDN hybrids (issue 35): the drafts' GDN state rolled back by replay.

References are independent of the code under test: `gdn_recurrent_reference` (the per-token
recurrence) and `causal_conv1d_reference` for the replayed state; for the engine, the same
configuration with `speculative_config` off and HF transformers' greedy `generate` on the same
safetensors. One pair of engines (on / off) per family serves the module: a small page pool
(preemption), a small token budget (chunked prefill) and prefix caching on (a second round of the
same prompts hits the cache, restoring GDN checkpoints).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy
from test_engine_hf import assert_all_free
from test_spec_decode import NUM_TOKENS, PROMPTS, SPEC, _greedy_requests, assert_drafting_compiles_nothing

from models import gdn_replay
from models.batch import ForwardBatch
from models.ops import KernelOptions
from pallas_kernels.causal_conv1d import causal_conv1d_reference
from pallas_kernels.gdn import gdn_recurrent_reference
from runtime.speculative import speculator
from runtime.types import EngineRequest, SamplingParams


# ---- the replay against the per-token reference ------------------------------------------------
def _replay_case(rng, S=5, K1=4, G=2, N=8, Hk=2, H=4, dk=8, dv=6, W=4, C=10):
    """Random stashed rows for S sequences (the last one padding), their slots and old states."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    k = f(G, S, K1, Hk, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    stash = {
        "x": f(G, S, K1, C),
        "k": k,
        "v": f(G, S, K1, H, dv),
        "g": -np.abs(f(G, S, K1, H)) * 0.3,
        "beta": 1 / (1 + np.exp(-f(G, S, K1, H))),
    }
    conv, rec = f(G * N, W - 1, C), f(G * N, H, dk, dv) * 0.1
    slots = np.array([3, 1, 6, 4, 0][:S], np.int32)
    spec_rows = np.full((S, K1), -1, np.int32)
    spec_rows[:3, :] = 0  # sequences 0-2 draft (rows themselves unused by `replay`), 3 does not, 4 is padding
    spec_rows[3, 0] = 0
    batch = ForwardBatch(
        *(np.zeros(1, np.int32),) * 6,
        state_slot_ids=slots,
        has_initial_state=np.array([True, True, False, True, False]),
        num_seqs=np.int32(S - 1),
        logits_indices=np.zeros(1, np.int32),
        spec_rows=spec_rows,
    )
    return {k: jnp.asarray(v) for k, v in stash.items()}, jnp.asarray(conv), jnp.asarray(rec), slots, batch


@pytest.mark.parametrize("gdn_impl", ["chunked", "native"])
def test_replayed_state_equals_token_by_token(gdn_impl):
    """For accepted counts 0 .. K (per sequence and layer group): the replayed conv and recurrent
    states equal the per-token reference run over the committed tokens; non-drafting sequences'
    slots and every other slot are untouched."""
    from pallas_kernels import cpu_native

    if gdn_impl == "native" and not cpu_native.available():
        pytest.skip("native CPU kernels unavailable")
    rng = np.random.default_rng(0)
    K1, G, N = 4, 2, 8
    stash, conv, rec, slots, batch = _replay_case(rng, K1=K1, G=G, N=N)
    conv_np, rec_np = np.asarray(conv), np.asarray(rec)
    opts = KernelOptions(attention="reference", gdn=gdn_impl)
    for accepted in ([0, 3, 1, 2, 0], [3, 0, 2, 3, 1], [1, 2, 3, 0, 0]):  # K = 3: 0 .. K each
        accepted = np.array(accepted, np.int32)
        caches = {"kv": (None,), "conv": (conv,), "rec": (rec,)}
        out = gdn_replay.replay(caches, (stash,), batch, jnp.asarray(accepted), opts)
        new_conv, new_rec = np.asarray(out["conv"][0]), np.asarray(out["rec"][0])
        touched = set()
        for g in range(G):
            for s in range(3):  # the drafting sequences
                slot = g * N + slots[s]
                touched.add(slot)
                n = int(accepted[s]) + 1
                start_rec = rec_np[slot] if batch.has_initial_state[s] else np.zeros_like(rec_np[slot])
                start_conv = conv_np[slot] if batch.has_initial_state[s] else np.zeros_like(conv_np[slot])
                at = lambda name, g=g, s=s, n=n: stash[name][g, s, :n]
                _, want = gdn_recurrent_reference(at("k"), at("k"), at("v"), at("g"), at("beta"), start_rec)
                np.testing.assert_allclose(new_rec[slot], np.asarray(want), rtol=1e-5, atol=1e-6)
                w = np.ones((conv.shape[2], conv.shape[1] + 1), np.float32)
                _, want_conv = causal_conv1d_reference(at("x"), w, start_conv)
                np.testing.assert_array_equal(new_conv[slot], np.asarray(want_conv))
        for slot in set(range(G * N)) - touched:
            np.testing.assert_array_equal(new_rec[slot], rec_np[slot])
            np.testing.assert_array_equal(new_conv[slot], conv_np[slot])


def test_count_zero_and_k_bound_the_replay():
    """A replay of 1 token differs from one of K + 1 (the test above can fail on a wrong count)."""
    rng = np.random.default_rng(1)
    stash, conv, rec, slots, batch = _replay_case(rng)
    opts = KernelOptions(attention="reference", gdn="chunked")
    caches = {"kv": (None,), "conv": (conv,), "rec": (rec,)}
    lo = gdn_replay.replay(caches, (stash,), batch, np.zeros(5, np.int32), opts)
    hi = gdn_replay.replay(caches, (stash,), batch, np.full(5, 3, np.int32), opts)
    assert not np.allclose(np.asarray(lo["rec"][0])[slots[0]], np.asarray(hi["rec"][0])[slots[0]])


# ---- the engine --------------------------------------------------------------------------------
def _engine(path, spec, **overrides):
    return spec_engine(path, spec, **{"num_pages": 64, "enable_prefix_caching": True, **overrides})


SCANNED_NEXT = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """family -> (engine with speculation, without, checkpoint path). Qwen3.5: the tests' tiny
    checkpoint and the CPU defaults (layers unrolled, the C++ recurrence). Qwen3-Next: four layers
    in two repetitions of (GDN, attention), scanned, with the jnp GDN path: stashes leave the layer
    scan stacked over groups, and the masked replay writes each group's slots."""
    built = {}

    def get(family):
        if family not in built:
            if family == "qwen3_next":
                from models.random_checkpoint import write_random_checkpoint

                path = write_random_checkpoint(family, tmp_path_factory.mktemp("next") / "ckpt", **SCANNED_NEXT)
                variant = {"layer_loop": "scan", "gdn_backend": "chunked"}
            else:
                path, variant = tiny_checkpoint(family), {}
            built[family] = (_engine(path, SPEC, **variant), _engine(path, None, **variant), path)
        return built[family]

    return get


def _hf(family, path, hf_model):
    if family != "qwen3_next":
        return hf_model(family)
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _serve(engine, requests):
    for request in requests:
        engine.add_request(request)
    done = drain(engine)
    assert_all_free(engine)
    return {rid: out.outputs[0] for rid, out in done.items()}


class OracleDrafts:
    """Drafts from the reference continuation with one draft spoiled, at index (3L + 1) % (k + 2)
    for a context of L tokens (k or more: all kept): accepted counts cycle through 0 .. k whatever the tiny
    random model's outputs (its greedy text rarely repeats, so prompt lookup alone is mostly
    rejected). Stands in for `propose_ngram`; exactness may not depend on where drafts come from."""

    def __init__(self, vocab: int):
        self.vocab, self.continuations = vocab, []

    def add(self, prompt: list[int], output: list[int]) -> None:
        self.continuations.append(list(prompt) + list(output))

    def __call__(self, tokens, k, min_n, max_n):
        L = len(tokens)
        for full in self.continuations:
            if len(full) > L and full[:L] == tokens.tolist():
                draft, spoil = full[L : L + k], (3 * L + 1) % (k + 2)
                if spoil < len(draft):
                    draft[spoil] = (draft[spoil] + 1) % self.vocab
                return draft
        return []


def _round(spec, off, requests, oracle, monkeypatch):
    """Serve `requests` without speculation, then with it (drafts from `oracle`, or prompt lookup)."""
    ref = _serve(off, requests)
    if oracle is not None:
        for r in requests:
            oracle.add(r.prompt_token_ids, ref[r.request_id].token_ids)
        monkeypatch.setattr(speculator, "propose_ngram", oracle)
    got = _serve(spec, requests)
    monkeypatch.undo()
    return got, ref


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_greedy_equals_no_speculation_and_hf(family, engines, hf_model, monkeypatch):
    """Chunked prefill, preemption and prefix hits (GDN checkpoints restored) with drafts both
    accepted (every count 0 .. k) and rejected: token for token the outputs without speculation,
    and HF's."""
    spec, off, path = engines(family)
    assert (spec.model.num_groups > 1) == (family == "qwen3_next")
    tokenizer = spec.tokenizer
    oracle = OracleDrafts(spec.model.cfg.vocab_size)
    before = spec.stats()
    got, ref = _round(spec, off, _greedy_requests(tokenizer, "g"), oracle, monkeypatch)  # chunked prefill, preemption
    hit_before = spec.stats()["prefix_cache_hit_tokens"]
    more = _round(spec, off, _greedy_requests(tokenizer, "h"), oracle, monkeypatch)  # the same prompts: prefix hits
    got.update(more[0])
    ref.update(more[1])
    # the next turn: prompt + output + more, hitting the state checkpoints saved while speculating
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    turns = [
        EngineRequest("c" + rid[1:], r.prompt_token_ids + got[rid].token_ids + r.prompt_token_ids[:5], params)
        for r in _greedy_requests(tokenizer, "g")[: len(PROMPTS)]
        for rid in [r.request_id]
    ]
    hit_before = spec.stats()["prefix_cache_hit_tokens"]
    more = _round(spec, off, turns, oracle, monkeypatch)
    assert spec.stats()["prefix_cache_hit_tokens"] - hit_before > sum(len(r.prompt_token_ids) for r in turns) // 2
    got.update(more[0])
    ref.update(more[1])
    stats = spec.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, stats  # drafts both accepted and rejected
    per_pos = (
        np.array(stats["spec_decode_num_accepted_tokens_per_pos"]) - before["spec_decode_num_accepted_tokens_per_pos"]
    )
    assert per_pos[-1] > 0, stats  # all k drafts accepted in some steps
    assert stats["num_preemptions"] > before["num_preemptions"], stats
    assert stats["prefix_cache_hit_tokens"] > hit_before, stats
    assert set(got) == set(ref)
    for rid, out in got.items():
        want = ref[rid]
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        assert len(out.token_ids) == NUM_TOKENS
    hf = _hf(family, path, hf_model)
    for i, prompt in enumerate(PROMPTS[:3]):
        expected, scores = hf_greedy(hf, tokenizer.encode(prompt), NUM_TOKENS)
        assert_greedy_match(got[f"g{i}"].token_ids, expected, scores, f"{family} {prompt!r}")


def test_prompt_lookup_drafts_on_a_hybrid(engines, monkeypatch):
    """The real n-gram drafter on prompts that quote the model's own earlier output (a few
    drafts accepted, most rejected): outputs unchanged."""
    spec, off, _ = engines("qwen3_5")
    tokenizer = spec.tokenizer
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    firsts = [EngineRequest(f"q{i}", tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)]
    first = _serve(off, firsts)
    quoting = [
        EngineRequest(f"r{i}", r.prompt_token_ids + first[r.request_id].token_ids + r.prompt_token_ids, params)
        for i, r in enumerate(firsts)
    ]
    before = spec.stats()["spec_decode_num_draft_tokens"]
    got, ref = _round(spec, off, quoting, None, monkeypatch)
    assert spec.stats()["spec_decode_num_draft_tokens"] > before
    assert {rid: o.token_ids for rid, o in got.items()} == {rid: o.token_ids for rid, o in ref.items()}


@pytest.mark.slow
def test_seeded_sampling_equals_no_speculation(engines, monkeypatch):
    """Temperature 1 with seeds: a drafted token is accepted exactly when the row's own sample
    equals it, so the outputs equal the plain engine's (drafts from those outputs, some spoiled)."""
    spec, off, _ = engines("qwen3_next")
    prompt = spec.tokenizer.encode(PROMPTS[2])
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=s, ignore_eos=True) for s in range(6)]
    requests = [EngineRequest(f"t{i}", prompt, p) for i, p in enumerate(params)]
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    got, ref = _round(spec, off, requests, OracleDrafts(spec.model.cfg.vocab_size), monkeypatch)
    assert spec.stats()["spec_decode_num_accepted_tokens"] > before
    assert {rid: o.token_ids for rid, o in got.items()} == {rid: o.token_ids for rid, o in ref.items()}


@pytest.mark.slow
def test_no_compile_after_startup_on_a_hybrid(tiny_checkpoint, monkeypatch):
    """Sealed start-up set on Qwen3.5 (the verify executables with the GDN replay included): a
    mixed workload plus drafting greedy and sampled requests compile nothing in the serving loop."""
    engine = _engine(
        tiny_checkpoint("qwen3_5"),
        SPEC,
        page_size=16,
        num_pages=64,
        max_num_batched_tokens=64,
        token_buckets=(8, 64),
        max_model_len=256,
        aot_compile=True,
        aot_compile_all=True,
    )
    monkeypatch.setattr(speculator, "propose_ngram", lambda tokens, k, lo, hi: [int(tokens[-1])] * k)  # always drafts
    assert_drafting_compiles_nothing(engine)


def test_bf16_state_replays_as_decode_steps_store_it():
    """A bf16 state pool: the replayed state equals one token at a time through the reference,
    rounded to bf16 after each (what decode steps commit)."""
    rng = np.random.default_rng(2)
    stash, conv, rec, slots, batch = _replay_case(rng)
    rec = rec.astype(jnp.bfloat16)
    accepted = np.array([2, 3, 1, 0, 0], np.int32)
    caches = {"kv": (None,), "conv": (conv,), "rec": (rec,)}
    out = gdn_replay.replay(caches, (stash,), batch, jnp.asarray(accepted), KernelOptions(gdn="chunked"))
    assert out["rec"][0].dtype == jnp.bfloat16
    N = rec.shape[0] // 2
    for g in range(2):
        for s in (0, 1):
            state = rec[g * N + slots[s]]
            for j in range(int(accepted[s]) + 1):
                at = lambda name, j=j: stash[name][g, s, j : j + 1]
                _, state = gdn_recurrent_reference(at("k"), at("k"), at("v"), at("g"), at("beta"), state)
                state = state.astype(jnp.bfloat16)
            np.testing.assert_array_equal(
                np.asarray(out["rec"][0][g * N + slots[s]], np.float32), np.asarray(state, np.float32)
            )


def test_penalties_and_logprobs_with_replayed_drafts(engines, monkeypatch):
    """Penalties (each verify row counting the drafts before it) and logprobs on a hybrid, drafts from
    the reference output with one spoiled (every accepted count occurs): tokens equal the outputs
    without speculation, and each token's logprob and top alternatives too."""
    spec, off, _ = engines("qwen3_5")
    tokenizer = spec.tokenizer
    kinds = [
        dict(repetition_penalty=1.2, logprobs=2),
        dict(frequency_penalty=0.4, presence_penalty=0.3),
        dict(temperature=1.0, seed=3, frequency_penalty=0.2, logprobs=1),
    ]
    requests = [
        EngineRequest(
            f"p{i}{j}",
            tokenizer.encode(p),
            SamplingParams(**{"temperature": 0.0, **kw}, max_tokens=NUM_TOKENS, ignore_eos=True),
        )
        for i, kw in enumerate(kinds)
        for j, p in enumerate(PROMPTS[:3])
    ]
    before = spec.stats()
    got, ref = _round(spec, off, requests, OracleDrafts(spec.model.cfg.vocab_size), monkeypatch)
    stats = spec.stats()
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 2 * len(requests), stats
    for rid, want in ref.items():
        out = got[rid]
        assert out.token_ids == want.token_ids, rid
        if want.logprobs is not None:
            for a, b in zip(out.logprobs, want.logprobs, strict=True):
                np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-4, atol=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top], rid
