"""`speculative_config: {method: mtp}` (issue 35): Qwen3.5 / Qwen3-Next draft with their own MTP layer.

References are independent of the code under test: the MTP module rebuilt in torch from HF's own
decoder-layer class with the checkpoint's `mtp.*` weights (`models.random_mtp.torch_mtp`), fed by HF's
target model, and run as vLLM's `Qwen3NextMultiTokenPredictor` does (written out below); for the
engine, the same configuration without speculation and HF's greedy `generate`. Every draft the
engine's MTP makes inside a verify step is compared with the torch chain for the same context, across
chunked prefill, preemption, prefix hits and accepted / rejected drafts (an oracle feeds the verify
step's drafts so that accepted counts cycle through 0 .. k while the MTP's own drafts are still logged).
"""

import shutil

import numpy as np
import pytest
from engine_testing import drain, spec_engine
from hf_reference import assert_greedy_match, hf_greedy
from test_engine_hf import assert_all_free
from test_spec_decode import NUM_TOKENS, PROMPTS, _greedy_requests, assert_drafting_compiles_nothing

from models.random_mtp import torch_mtp
from runtime.speculative import speculator
from runtime.types import EngineRequest, SamplingParams

K = 3
SPEC = {"method": "mtp", "num_speculative_tokens": K}


def _engine(path, spec, **overrides):
    return spec_engine(path, spec, **{"num_pages": 64, "enable_prefix_caching": True, **overrides})


# ---- the torch reference ------------------------------------------------------------------------
class TorchMTP:
    """vLLM's MTP math on HF modules: e = fc([norm_e(embed(x[t+1])) | norm_h(h[t])]), the decoder
    layer (causal, RoPE at t), the MTP's final norm, the target's lm_head; h: the target's
    final-norm output, then for later drafts the MTP's own output."""

    def __init__(self, hf, path, sequences=()):
        import torch

        self.torch, self.hf, self.mtp = torch, hf, torch_mtp(hf, path).float()
        self.mrope = "mrope_section" in (getattr(hf.config, "rope_parameters", None) or {})
        self.sequences = [list(s) for s in sequences]  # optional: whole sequences whose prefixes contexts are
        self._hidden: dict[tuple, object] = {}

    def target_hidden(self, tokens: list[int]):
        """HF's final-norm output [L, H] at `tokens`: a slice of a longer sequence's (causal: the
        same states) when one in `sequences` starts with them, run once per such sequence."""
        full = next((s for s in self.sequences if len(s) >= len(tokens) and s[: len(tokens)] == tokens), tokens)
        key = tuple(full)
        if key not in self._hidden:
            with self.torch.no_grad():
                self._hidden[key] = self.hf.model(input_ids=self.torch.tensor([full])).last_hidden_state[0]
        return self._hidden[key][: len(tokens)]

    def drafts(self, context: list[int], k: int) -> tuple[list[int], list[np.ndarray]]:
        """The k greedy drafts after `context` (its last token not yet run by the target), and the
        logits [V] of each."""
        torch, hf, mtp = self.torch, self.hf, self.mtp
        with torch.no_grad():
            h = self.target_hidden(list(context[:-1]))  # [L-1, H]
            tokens, hidden, out, logits = list(context[1:]), list(h), [], []
            for _ in range(k):
                n = len(tokens)
                e = mtp.pre_fc_norm_embedding(hf.model.embed_tokens(torch.tensor([tokens])))
                x = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(torch.stack(hidden)[None])], -1))
                pos = torch.arange(n)[None]
                rope = hf.model.rotary_emb(x, pos[None].expand(3, 1, n) if self.mrope else pos)
                mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
                y = mtp.norm(mtp.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=pos))
                row = hf.lm_head(y[0, -1]).float()
                out.append(int(row.argmax()))
                logits.append(row.numpy())
                tokens.append(out[-1])
                hidden.append(y[0, -1])
        return out, logits


def assert_drafts_match(ref: TorchMTP, log, min_checked: int):
    """Each logged (context, drafts) equals the torch chain; a near tie (the reference's logits of
    the two tokens within 1e-4) ends that chain's comparison."""
    checked = 0
    for context, drafts in log:
        want, logits = ref.drafts(list(context), len(drafts))
        for got, exp, row in zip(drafts, want, logits):
            if got != exp:
                assert row.max() - row[got] < 1e-4, (context, drafts, want)
                break
            checked += 1
    assert checked >= min_checked, (checked, len(log))


# ---- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """family -> (engine with MTP speculation, without, checkpoint path). Qwen3-Next: four layers in
    two repetitions of (GDN, attention), scanned, jnp GDN path (its MTP layer is MoE)."""
    built = {}

    def get(family):
        if family not in built:
            if family == "qwen3_next":
                from models.random_checkpoint import write_random_checkpoint

                layers = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
                path = write_random_checkpoint(family, tmp_path_factory.mktemp("next") / "ckpt", **layers)
                variant = {"layer_loop": "scan", "gdn_backend": "chunked"}
            else:
                path, variant = tiny_checkpoint(family), {}
            built[family] = (_engine(path, SPEC, **variant), _engine(path, None, **variant), path)
        return built[family]

    return get


def _serve(engine, requests):
    for request in requests:
        engine.add_request(request)
    done = drain(engine)
    assert_all_free(engine)
    return {rid: out.outputs[0] for rid, out in done.items()}


class OracleMTP:
    """Stands in for `propose_mtp`: the reference continuation's next k tokens with one spoiled (at
    (3L + 1) % (k + 2) for a context of L tokens), so accepted counts cycle through 0 .. k; the MTP
    still drafts in the step (its drafts are logged, not verified)."""

    def __init__(self, vocab: int):
        self.vocab, self.continuations = vocab, []

    def __call__(self, req, k):
        tokens, L = list(req.all_token_ids), req.num_tokens
        for full in self.continuations:
            if len(full) > L and full[:L] == tokens:
                draft, spoil = full[L : L + k], (3 * L + 1) % (k + 2)
                if spoil < len(draft):
                    draft[spoil] = (draft[spoil] + 1) % self.vocab
                return draft + [speculator.MTP_DRAFT] * (k - len(draft))
        return [speculator.MTP_DRAFT] * k


def _round(spec, off, requests, oracle, monkeypatch):
    ref = _serve(off, requests)
    if oracle is not None:
        oracle.continuations += [r.prompt_token_ids + ref[r.request_id].token_ids for r in requests]
        monkeypatch.setattr(speculator, "propose_mtp", oracle)
    got = _serve(spec, requests)
    monkeypatch.undo()
    return got, ref


def _check_greedy(family, engines, hf_model, monkeypatch, path_hf):
    spec, off, path = engines(family)
    tokenizer = spec.tokenizer
    spec.speculator.draft_log = []
    before = spec.stats()
    got, ref = _round(spec, off, _greedy_requests(tokenizer, "g"), None, monkeypatch)  # the MTP's own drafts
    oracle = OracleMTP(spec.model.cfg.vocab_size)
    hits = spec.stats()["prefix_cache_hit_tokens"]
    more = _round(spec, off, _greedy_requests(tokenizer, "h"), oracle, monkeypatch)  # prefix hits, accepted drafts
    got.update(more[0])
    ref.update(more[1])
    stats = spec.stats()
    drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, stats
    per_pos = (
        np.array(stats["spec_decode_num_accepted_tokens_per_pos"]) - before["spec_decode_num_accepted_tokens_per_pos"]
    )
    assert per_pos[-1] > 0, stats  # all k drafts accepted in some steps
    assert stats["num_preemptions"] > before["num_preemptions"], stats
    assert stats["prefix_cache_hit_tokens"] > hits, stats
    assert set(got) == set(ref)
    for rid, out in got.items():
        want = ref[rid]
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        assert len(out.token_ids) == NUM_TOKENS
    hf = path_hf(path)
    for i, prompt in enumerate(PROMPTS[:3]):
        expected, scores = hf_greedy(hf, tokenizer.encode(prompt), NUM_TOKENS)
        assert_greedy_match(got[f"g{i}"].token_ids, expected, scores, f"{family} {prompt!r}")
    log, spec.speculator.draft_log = spec.speculator.draft_log, None
    assert_drafts_match(TorchMTP(hf, path), log, min_checked=len(log))


def test_mtp_drafts_and_greedy_output_qwen3_5(engines, hf_model, monkeypatch):
    """Qwen3.5: greedy output with MTP equals no speculation and HF (chunked prefill, preemption,
    prefix hits; drafts accepted and rejected), and every MTP draft equals the torch reference's."""
    _check_greedy("qwen3_5", engines, hf_model, monkeypatch, lambda path: hf_model("qwen3_5"))


@pytest.mark.slow
def test_mtp_drafts_and_greedy_output_qwen3_next(engines, hf_model, monkeypatch):
    """Qwen3-Next (scanned layer groups, an MoE MTP layer): as above."""
    import torch
    from transformers import AutoModelForCausalLM

    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check_greedy("qwen3_next", engines, hf_model, monkeypatch, load)


def test_sampled_logprobs_and_penalties_equal_no_speculation(engines, monkeypatch):
    """Seeded temperature-1 sampling (rejection sampling of a deterministic draft), logprobs and
    penalties with drafts accepted (the oracle's) and the MTP running: the same tokens and logprobs
    as without speculation."""
    spec, off, _ = engines("qwen3_5")
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3),
    ]
    prompts = [spec.tokenizer.encode(p) for p in PROMPTS[:3]]
    requests = [EngineRequest(f"t{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    got, ref = _round(spec, off, requests, OracleMTP(spec.model.cfg.vocab_size), monkeypatch)
    assert spec.stats()["spec_decode_num_accepted_tokens"] > before
    for rid, want in ref.items():
        assert got[rid].token_ids == want.token_ids, rid
        for a, b in zip(got[rid].logprobs or [], want.logprobs or []):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top], rid
            np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-4, atol=1e-4)
    assert len(got["t1"].logprobs) == 12


def test_pages_budget_the_mtp_layer(engines):
    """A budget-sized pool counts the MTP layer's K/V: one more attention layer per page."""
    from runtime.engine.construction import page_bytes

    spec, off, _ = engines("qwen3_5")
    n = spec.model.cfg.num_attention_layers
    assert page_bytes(spec.config, spec.model) * n == page_bytes(off.config, off.model) * (n + 1)
    assert spec.caches["mtp"]["kv"].k.shape[0] == off.caches["kv"][1].k.shape[0] // spec.model.num_groups


# ---- refusals -----------------------------------------------------------------------------------
def test_refused_without_mtp_weights(tiny_checkpoint, tmp_path):
    """Llama, and a Qwen3.5 checkpoint stripped of its MTP layer: refused at start-up, by name."""
    with pytest.raises(ValueError, match="speculative_config: method 'mtp' needs a Qwen3.5 / Qwen3-Next"):
        _engine(tiny_checkpoint("llama"), SPEC)
    stripped = tmp_path / "q35"
    shutil.copytree(tiny_checkpoint("qwen3_5"), stripped, ignore=shutil.ignore_patterns("mtp.safetensors"))
    with pytest.raises(ValueError, match="has no MTP weights"):
        _engine(stripped, SPEC)


@pytest.mark.slow
def test_no_compile_after_startup_with_mtp(tiny_checkpoint):
    """Sealed start-up set on Qwen3.5 with the MTP layer (its K/V in every step, its drafts in the
    verify executables): a mixed workload plus drafting greedy and sampled requests compile nothing."""
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
    assert_drafting_compiles_nothing(engine)


# ---- grammars -----------------------------------------------------------------------------------
def test_grammar_requests_draft_with_the_mtp(engines, hf_model, monkeypatch):
    """A grammar-masked verify step also makes each sequence's next MTP drafts (`device_drafts.next_drafts`),
    which the host checks against the grammar before it builds the next step's masks, as for
    prompt lookup. JSON-schema and regex constrained greedy requests equal no speculation token for
    token, and every output is valid for its grammar (a fresh matcher walks it); they draft with the
    MTP's own drafts (each equal to the torch reference's for its context) and, drafting the
    oracle's, accept some."""
    import json

    from structured_cases import json_schemas, regexes

    from runtime.structured_output import build_compiler
    from runtime.structured_output.manager import StructuredOutputManager
    from runtime.types import StructuredOutput

    spec, off, path = engines("qwen3_5")
    tok, cfg = spec.tokenizer, spec.model.cfg
    grammars = [StructuredOutput("json", json.dumps(s)) for s in json_schemas(40)[::10]]
    grammars += [StructuredOutput("regex", r) for r in regexes(12)[::4]]
    grammars += [StructuredOutput("regex", r"[\s\S]{1,200}")]  # lets the random MTP's drafts through

    def requests(tag):
        return [
            EngineRequest(f"{tag}{i}", tok.encode(PROMPTS[i % len(PROMPTS)]),
                          SamplingParams(max_tokens=24, temperature=0.0, structured_output=g))
            for i, g in enumerate(grammars)
        ]  # fmt: skip

    def drafted_accepted(before):
        s = spec.stats()
        return tuple(
            s[key] - before[key] for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        )

    spec.speculator.draft_log = []
    before = spec.stats()
    got, want = _round(spec, off, requests("j"), None, monkeypatch)  # the MTP's own drafts
    assert drafted_accepted(before)[0] > 0
    log, spec.speculator.draft_log = spec.speculator.draft_log, None
    before = spec.stats()
    more = _round(spec, off, requests("k"), OracleMTP(cfg.vocab_size), monkeypatch)
    drafted, accepted = drafted_accepted(before)
    assert 0 < accepted < drafted, (drafted, accepted)
    got.update(more[0])
    want.update(more[1])
    assert set(got) == set(want)
    walk = StructuredOutputManager(build_compiler(tok, cfg.vocab_size, tuple(cfg.eos_token_ids)), max_rows=1)
    for rid, out in got.items():
        ref = want[rid]
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), rid
        walk.add(rid, grammars[int(rid[1:])])
        assert walk.allowed_drafts(rid, out.token_ids) == len(out.token_ids), (rid, out.text)
    assert sum(out.finish_reason == "stop" for out in got.values()) >= len(got) // 2
    assert len(spec.structured_output) == 0
    assert_drafts_match(TorchMTP(hf_model("qwen3_5"), path), log, min_checked=len(log))


# ---- the host-memory tier -----------------------------------------------------------------------
def test_mtp_drafts_after_host_tier_hits_equal_the_reference(engines, tiny_checkpoint, hf_model, monkeypatch):
    """A host-tier hit (cache.kv_offloading_size) restores the MTP layer's K/V pages and carry with
    the target's pages and GDN checkpoints (runtime/engine/host_tier.py), so the first drafts after
    it are the torch reference's, as after a device hit; greedy output equals no speculation."""
    spec, off, path = engines("qwen3_5")
    tiered = _engine(
        path, SPEC, num_pages=18, num_state_slots=5, max_num_seqs=2, max_model_len=64, kv_offloading_size=0.01
    )
    tiered.speculator.draft_log = []
    rng = np.random.default_rng(5)
    draw = lambda n: rng.integers(3, spec.model.cfg.vocab_size, size=n).tolist()
    convs = {f"c{i}": draw(18) for i in range(4)}  # no shared prefix (its last MTP row is whoever's ran last)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts, got = {}, {}
    for turn in range(3):
        wave = {f"{cid}t{turn}": ids for cid, ids in convs.items()}
        prompts.update(wave)
        got.update(_serve(tiered, [EngineRequest(rid, ids, params) for rid, ids in wave.items()]))
        for cid in convs:
            convs[cid] = convs[cid] + got[f"{cid}t{turn}"].token_ids + draw(3)
    stats = tiered.stats()
    assert stats["host_cache_pages_loaded"] > 0 and stats["host_cache_checkpoints_loaded"] > 0, stats
    want = _serve(off, [EngineRequest(rid, ids, params) for rid, ids in prompts.items()])
    assert {rid: out.token_ids for rid, out in got.items()} == {rid: out.token_ids for rid, out in want.items()}
    log, tiered.speculator.draft_log = tiered.speculator.draft_log, None
    assert_drafts_match(TorchMTP(hf_model("qwen3_5"), path), log, min_checked=len(log))


def test_mtp_drafts_after_preemption_swaps_equal_the_reference(engines, hf_model):
    """Preemption by swap (paged_kv/preempt_swap.py) with the MTP: a swapped-out request's partial
    last page carries the MTP layer's K/V and its running slot the MTP's hidden carry, so the drafts
    after it resumes are the torch reference's (a carry or page left behind would differ); nothing
    is recomputed and greedy output equals no speculation."""
    from paged_kv.tiered_cache import SwapCost

    spec, off, path = engines("qwen3_5")
    swapping = _engine(
        path, SPEC, num_pages=25, num_state_slots=9, max_num_seqs=4, max_model_len=64, kv_offloading_size=0.01
    )
    swapping.scheduler.cache.swap_cost = SwapCost(1e30, 0.0, 1e-9)  # loading anything beats recomputing
    swapping.speculator.draft_log = []
    rng = np.random.default_rng(7)
    vocab = spec.model.cfg.vocab_size
    prompts = {f"s{i}": rng.integers(3, vocab, size=int(rng.integers(13, 27))).tolist() for i in range(6)}
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    got = _serve(swapping, [EngineRequest(rid, ids, params) for rid, ids in prompts.items()])
    stats = swapping.stats()
    assert stats["host_cache_swap_ins"] > 0 and stats["preemption_recomputed_tokens"] == 0, stats
    want = _serve(off, [EngineRequest(rid, ids, params) for rid, ids in prompts.items()])
    assert {rid: out.token_ids for rid, out in got.items()} == {rid: out.token_ids for rid, out in want.items()}
    log, swapping.speculator.draft_log = swapping.speculator.draft_log, None
    assert_drafts_match(TorchMTP(hf_model("qwen3_5"), path), log, min_checked=len(log))
