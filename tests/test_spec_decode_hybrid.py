"""Speculative decoding on KDA (Kimi Linear) and Mamba-2 (Nemotron-H) hybrids (issue 35): replay.

References are independent of the code under test: numpy recurrences written here (KDA's gated
delta rule with a per-channel decay, the Mamba-2 SSM step, the conv state as the last W-1 raw
inputs) for the replayed state after accepting j of k drafts, every j in 0..k; for the engine, the
same configuration with `speculative_config` off and HF transformers' greedy `generate` on the same
safetensors. One pair of engines (on / off) per family, shared by the module: a small token budget
(chunked prefill) and prefix caching on (a second round of the same prompts, and a next turn
quoting the output, hit the cache and restore state checkpoints saved while speculating).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy, random_prompt
from test_engine_hf import assert_all_free
from test_spec_decode import SPEC
from test_spec_decode_gdn import OracleDrafts

from models import hybrid_replay
from models.batch import ForwardBatch
from models.ops import KernelOptions
from runtime.speculative import speculator
from runtime.types import EngineRequest, SamplingParams

K1, G, N, W = 4, 2, 8, 4  # k = 3 drafts; two layer groups of 8 slots; a 4-tap conv
SLOTS = np.array([3, 1, 6, 4, 0], np.int32)  # sequences 0-2 draft, 3 does not, 4 is padding
HAS_INITIAL = np.array([True, True, False, True, False])


def _batch() -> ForwardBatch:
    spec_rows = np.full((5, K1), -1, np.int32)
    spec_rows[:3, :] = 0  # drafting (the rows themselves are unused by the replay)
    spec_rows[3, 0] = 0
    return ForwardBatch(
        *(np.zeros(1, np.int32),) * 6,
        state_slot_ids=SLOTS,
        has_initial_state=HAS_INITIAL,
        num_seqs=np.int32(4),
        logits_indices=np.zeros(1, np.int32),
        spec_rows=spec_rows,
    )


def _kda_case(rng, H=4, Hk=2, dk=8, dv=6, C=10):
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    k = f(G, 5, K1, Hk, dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    stash = {
        "x": f(G, 5, K1, C),
        "k": k,
        "v": f(G, 5, K1, H, dv),
        "g": -np.abs(f(G, 5, K1, H, dk)) * 0.5,  # a decay per key channel
        "beta": 1 / (1 + np.exp(-f(G, 5, K1, H))),
    }
    return stash, f(G * N, W - 1, C), f(G * N, H, dk, dv) * 0.1


def _kda_numpy(state, stash, g, s, n):
    """KDA's recurrence over the first n tokens, float64: S' = S exp(g) per key channel,
    S = S' + beta k (v - k^T S')^T (value head h reads key head h // (H / Hk))."""
    S = state.astype(np.float64)
    H = S.shape[0]
    for t in range(n):
        k = np.repeat(stash["k"][g, s, t], H // stash["k"].shape[3], axis=0).astype(np.float64)  # [H, dk]
        v, gt, beta = (stash[name][g, s, t].astype(np.float64) for name in ("v", "g", "beta"))
        S = S * np.exp(gt)[:, :, None]
        r = v - np.einsum("hk,hkv->hv", k, S)
        S = S + beta[:, None, None] * k[:, :, None] * r[:, None, :]
    return S


def _ssm_case(rng, H=4, P=3, Gb=2, Nst=5, C=11):
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    A = -np.exp(f(H) * 0.5)
    stash = {
        "x": f(G, 5, K1, C),
        "xs": f(G, 5, K1, H, P),
        "dt": np.log1p(np.exp(f(G, 5, K1, H))),  # processed: softplus, > 0
        "b": f(G, 5, K1, Gb, Nst),
        "A": np.broadcast_to(A, (G, 5, H)).copy(),
    }
    return stash, f(G * N, W - 1, C), f(G * N, H, P, Nst) * 0.1


def _ssm_numpy(state, stash, g, s, n):
    """The Mamba-2 SSM over the first n tokens, float64: S = exp(dt A) S + dt x B^T (head h reads
    B group h // (H / G))."""
    S = state.astype(np.float64)
    H = S.shape[0]
    for t in range(n):
        x, dt = stash["xs"][g, s, t].astype(np.float64), stash["dt"][g, s, t].astype(np.float64)
        b = np.repeat(stash["b"][g, s, t], H // stash["b"].shape[3], axis=0).astype(np.float64)  # [H, N]
        decay = np.exp(dt * stash["A"][g, s].astype(np.float64))
        S = decay[:, None, None] * S + (dt[:, None] * x)[:, :, None] * b[:, None, :]
    return S


def _conv_numpy(old, x, n):
    """The conv state after n more raw inputs: the last W-1 rows of old ++ x[:n]."""
    return np.concatenate([old, x[:n]], axis=0)[-old.shape[0] :]


@pytest.mark.parametrize(
    "mixer, case, reference, rtol",
    [("kda", _kda_case, _kda_numpy, 2e-5), ("mamba2", _ssm_case, _ssm_numpy, 2e-5)],
)
def test_replayed_state_equals_token_by_token(mixer, case, reference, rtol):
    """For accepted counts 0 .. k (per sequence and layer group): the replayed conv and recurrent
    states equal the numpy recurrence over the committed tokens; a sequence without drafts, the
    padding sequence and every other slot are untouched."""
    stash, conv, rec = case(np.random.default_rng(0))
    replay = hybrid_replay.replay_for(_cfg(mixer))
    batch = _batch()
    seen = set()
    for accepted in ([0, 3, 1, 2, 0], [3, 0, 2, 3, 1], [1, 2, 3, 0, 0], [2, 1, 0, 1, 2]):
        accepted = np.array(accepted, np.int32)
        caches = {"kv": (None,), "conv": (jnp.asarray(conv),), "rec": (jnp.asarray(rec),)}
        stashes = ({k: jnp.asarray(v) for k, v in stash.items()},)
        out = replay(caches, stashes, batch, jnp.asarray(accepted), KernelOptions(attention="reference"))
        new_conv, new_rec = np.asarray(out["conv"][0]), np.asarray(out["rec"][0])
        touched = set()
        for g in range(G):
            for s in range(3):
                slot, n = g * N + SLOTS[s], int(accepted[s]) + 1
                seen.add(n)
                touched.add(slot)
                start_rec = rec[slot] if HAS_INITIAL[s] else np.zeros_like(rec[slot])
                start_conv = conv[slot] if HAS_INITIAL[s] else np.zeros_like(conv[slot])
                want = reference(start_rec, stash, g, s, n)
                np.testing.assert_allclose(new_rec[slot], want, rtol=rtol, atol=1e-6, err_msg=f"{mixer} n={n}")
                np.testing.assert_array_equal(new_conv[slot], _conv_numpy(start_conv, stash["x"][g, s], n))
        for slot in set(range(G * N)) - touched:
            np.testing.assert_array_equal(new_rec[slot], rec[slot])
            np.testing.assert_array_equal(new_conv[slot], conv[slot])
    assert seen == {1, 2, 3, 4}


def _cfg(mixer):
    """The two fields `replay_for` reads."""

    @dataclasses.dataclass
    class Cfg:
        kda: bool
        mamba: object

    return Cfg(kda=mixer == "kda", mamba=object() if mixer == "mamba2" else None)


@pytest.mark.parametrize("mixer, case", [("kda", _kda_case), ("mamba2", _ssm_case)])
def test_bf16_state_replays_as_decode_steps_store_it(mixer, case):
    """A bf16 pool: each token's state is rounded to bf16 before the next (what decode steps
    commit), so the replay differs from one unrounded pass; and 1 token differs from k + 1."""
    stash, conv, rec = case(np.random.default_rng(1))
    replay = hybrid_replay.replay_for(_cfg(mixer))
    stashes = ({k: jnp.asarray(v) for k, v in stash.items()},)

    def run(pool, accepted):
        caches = {"kv": (None,), "conv": (jnp.asarray(conv),), "rec": (pool,)}
        return np.asarray(
            replay(caches, stashes, _batch(), jnp.full(5, accepted, jnp.int32), KernelOptions())["rec"][0], np.float32
        )

    slot = SLOTS[0]
    lo, hi = run(jnp.asarray(rec), 0)[slot], run(jnp.asarray(rec), 3)[slot]
    assert not np.allclose(lo, hi)
    bf16 = jnp.asarray(rec).astype(jnp.bfloat16)
    got = run(bf16, 3)[slot]
    state = np.asarray(bf16[slot], np.float32)
    for t in range(K1):  # one token at a time through the numpy step, rounded after each
        one = {k: v[:, :, t : t + 1] if v.ndim > 3 else v for k, v in stash.items()}
        state = np.asarray(
            jnp.asarray(reference_for(mixer)(state, one, 0, 0, 1), jnp.float32).astype(jnp.bfloat16), np.float32
        )
    np.testing.assert_allclose(got, state, rtol=0, atol=2**-7 * np.abs(state).max())


def reference_for(mixer):
    return _kda_numpy if mixer == "kda" else _ssm_numpy


# ---- the engine --------------------------------------------------------------------------------
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """family -> (engine with ngram speculation, without, checkpoint path): pages of 4, 32-token
    steps (prompts prefill in chunks) in one token bucket (compile time), prefix caching with
    state checkpoints."""
    built = {}

    def get(family):
        if family not in built:
            path = tiny_checkpoint(family)
            kw = dict(num_pages=96, enable_prefix_caching=True, load_tokenizer=False, token_buckets=(32,))
            built[family] = (spec_engine(path, SPEC, **kw), spec_engine(path, None, **kw), path)
        return built[family]

    return get


def _serve(engine, requests):
    for request in requests:
        engine.add_request(request)
    done = drain(engine)
    assert_all_free(engine)
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def _round(spec, off, requests, oracle, monkeypatch):
    """Serve `requests` without speculation, then with it (drafts from `oracle`, or prompt lookup)."""
    ref = _serve(off, requests)
    if oracle is not None:
        for r in requests:
            oracle.add(r.prompt_token_ids, ref[r.request_id])
        monkeypatch.setattr(speculator, "propose_ngram", oracle)
    got = _serve(spec, requests)
    monkeypatch.undo()
    assert got == ref
    return got


def _hf(path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _copy_heavy(vocab: int, tag: str) -> list[EngineRequest]:
    """Prompts that repeat themselves (prompt lookup drafts from them), 20 to 45 tokens: the longer
    ones prefill in two chunks."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    out = []
    for i, n in enumerate((6, 9, 12, 15)):
        p = random_prompt(vocab, n, seed=900 + i)
        out.append(EngineRequest(f"{tag}{i}", p * 3 + p[: n // 2], params))
    return out


def _exact_with_drafts(family, engines, monkeypatch, num_hf=2):
    spec, off, path = engines(family)
    vocab = spec.model.cfg.vocab_size
    before = spec.stats()
    requests = _copy_heavy(vocab, "a")
    got = _round(spec, off, requests, None, monkeypatch)  # prompt lookup, chunked prefill
    lookup = spec.stats()
    assert lookup["spec_decode_num_draft_tokens"] > before["spec_decode_num_draft_tokens"], lookup
    oracle = OracleDrafts(vocab)
    _round(spec, off, _copy_heavy(vocab, "b"), oracle, monkeypatch)  # the same prompts, every accepted count
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    turns = [  # the next turn: prompt + output + more, hitting state checkpoints saved while speculating
        EngineRequest("c" + r.request_id, r.prompt_token_ids + got[r.request_id] + r.prompt_token_ids[:5], params)
        for r in requests
    ]
    hits = spec.stats()["prefix_cache_hit_tokens"]
    _round(spec, off, turns, oracle, monkeypatch)
    stats = spec.stats()
    assert stats["prefix_cache_hit_tokens"] - hits > sum(len(r.prompt_token_ids) for r in turns) // 2, stats
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, stats  # drafts both accepted and rejected
    per_pos = (
        np.array(stats["spec_decode_num_accepted_tokens_per_pos"]) - before["spec_decode_num_accepted_tokens_per_pos"]
    )
    assert per_pos[-1] > 0, stats  # all k drafts accepted in some steps
    hf = _hf(path)
    for r in requests[:num_hf]:
        expected, scores = hf_greedy(hf, r.prompt_token_ids, NUM_TOKENS)
        assert_greedy_match(got[r.request_id], expected, scores, f"{family} {r.request_id}")


def test_kimi_linear_greedy_equals_no_speculation_and_hf(engines, monkeypatch):
    """Kimi Linear (KDA + MLA), prompt lookup and then drafts both accepted (every count 0 .. k) and
    rejected, under chunked prefill and prefix hits: token for token the output without
    speculation, and HF's."""
    _exact_with_drafts("kimi_linear", engines, monkeypatch)


@pytest.mark.slow
def test_nemotron_h_greedy_equals_no_speculation_and_hf(engines, monkeypatch):
    """Nemotron-H (Mamba-2 + attention + MLP blocks): as the Kimi Linear test."""
    _exact_with_drafts("nemotron_h", engines, monkeypatch)


@pytest.mark.parametrize("family", ["kimi_linear", "nemotron_h"])
def test_mtp_is_refused_precisely(family, tiny_checkpoint):
    """Neither family ships MTP layers: `method: mtp` is refused at load, naming why."""
    with pytest.raises(ValueError, match="method 'mtp' needs a Qwen3.5 / Qwen3-Next checkpoint with MTP layers"):
        spec_engine(tiny_checkpoint(family), {"method": "mtp", "num_speculative_tokens": 2}, load_tokenizer=False)


def test_kda_and_mamba2_under_a_mesh_are_refused():
    """The replay of KDA and Mamba-2 layers runs on one device: under a mesh (`model.tp`) the
    speculator refuses them by name; GDN hybrids and dense models under a mesh pass this check."""
    from types import SimpleNamespace

    def engine(kda=False, layer_types=("linear_attention",), tp=None):
        cfg = SimpleNamespace(kda=kda, layer_types=list(layer_types))
        config = SimpleNamespace(kv_transfer=None, speculative_config=SimpleNamespace(method="ngram"))
        table = SimpleNamespace(window_columns=None)
        return SimpleNamespace(model=SimpleNamespace(cfg=cfg, tp=tp), dp=None, config=config, request_table=table)

    mesh = object()
    why = "KDA and Mamba-2 hybrids under a mesh are not supported yet"
    assert speculator.refusal(engine(kda=True, tp=mesh)).startswith(why)
    assert speculator.refusal(engine(layer_types=("mamba", "full_attention"), tp=mesh)).startswith(why)
    assert speculator.refusal(engine(kda=True)) is None
    assert speculator.refusal(engine(layer_types=("mamba", "full_attention"))) is None
    assert speculator.refusal(engine(tp=mesh)) is None  # GDN: tests/test_spec_decode_parallel.py
