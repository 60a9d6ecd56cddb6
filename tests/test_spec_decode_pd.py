"""`method: mtp` and `method: draft_model` on a P/D decode instance (issue 35; runtime/kv_transfer/spec_layout.py).

References: a colocated engine without speculation (the output) and a colocated engine drafting with
the same method (the drafts: an MTP draft is a function of its context once the MTP's K/V and carry
are those a colocated engine holds). Each check also runs once with the drafter's state left out of
the pull (the behaviour before issue 35) and sees the drafts change, so none of them can pass
vacuously. Requests travel through the in-process connector of tests/test_kv_transfer.py.
"""

from __future__ import annotations

import pytest
from engine_testing import drain, small_engine_config
from test_kv_transfer import plugin  # noqa: F401 (the in-process connector's fixture)
from test_spec_decode import PROMPTS

from runtime.engine.llm_engine import LLMEngine
from runtime.kv_transfer import KVTransferConfig, hooks
from runtime.types import EngineRequest, SamplingParams

K = 3
NUM_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
SMALL = dict(page_size=4, num_pages=64, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 16, 32))
MTP = {"method": "mtp", "num_speculative_tokens": K}


def _engine(path, spec=None, role=None, connector=None):
    kv = None if role is None else KVTransferConfig(role=role, **({"connector": connector} if connector else {}))
    return LLMEngine(small_engine_config(path, **SMALL, max_model_len=128, speculative_config=spec, kv_transfer=kv))


def _all_free(engine):
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s


def _serve(engine, requests) -> dict:
    for r in requests:
        engine.add_request(r)
    return {rid: out.outputs[0].token_ids for rid, out in drain(engine).items()}


def _requests(tokenizer, tag: str) -> list[EngineRequest]:
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]] + [tokenizer.encode(PROMPTS[1] * 2)]
    return [EngineRequest(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)]


def _through_pd(prefill, decode, reqs, edit=lambda desc: desc) -> dict:
    """Serve `reqs` on the prefill side, then on the decode side with the offered state (each
    descriptor passed through `edit`)."""
    legs = [EngineRequest(r.request_id, r.prompt_token_ids, GREEDY, kv_transfer_params={"do_remote_decode": True})
            for r in reqs]  # fmt: skip
    for r in legs:
        prefill.add_request(r)
    offered = {rid: out.kv_transfer_params for rid, out in drain(prefill).items()}
    assert all(offered.values()), offered
    for params in offered.values():
        params["descriptor"] = edit(params["descriptor"])
    pulled = [EngineRequest(r.request_id, r.prompt_token_ids, GREEDY, kv_transfer_params=offered[r.request_id])
              for r in reqs]  # fmt: skip
    return _serve(decode, pulled)


def _logged(engine, run) -> tuple[object, dict]:
    """run() with the speculator's draft log on -> (its result, {context: drafts})."""
    engine.speculator.draft_log = []
    result = run()
    log, engine.speculator.draft_log = engine.speculator.draft_log, None
    return result, {tuple(ctx): tuple(int(t) for t in drafts) for ctx, drafts in log}


def _counts(engine, before) -> tuple[int, int]:
    s = engine.stats()
    return (
        s["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"],
        s["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"],
    )


# ---- method: mtp (tiny Qwen3.5) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_engines(plugin, tiny_checkpoint):  # noqa: F811
    """(prefill instance with `method: mtp` (it ships the MTP state), decode instance with the MTP, colocated with the
    MTP, colocated without speculation): tiny Qwen3.5, no prefix caching (a shared page's MTP rows
    are written by whichever request runs next: drafts would then depend on the order)."""
    path = tiny_checkpoint("qwen3_5")
    return (
        _engine(path, MTP, role="prefill", connector=plugin),
        _engine(path, MTP, role="decode", connector=plugin),
        _engine(path, MTP),
        _engine(path),
    )


def test_mtp_drafts_after_pull_equal_colocated(mtp_engines, monkeypatch):
    """The prefill instance ships the MTP's rows and carry; the decode side's output equals no
    speculation and its MTP drafts equal a colocated MTP engine's for every context both drafted."""
    prefill, decode, colocated, off = mtp_engines
    assert "mtp" in prefill.caches and prefill.speculator is None  # it computes the MTP state, drafts nothing
    reqs = _requests(decode.tokenizer, "m")
    want = _serve(off, reqs)
    got_colocated, ref = _logged(colocated, lambda: _serve(colocated, reqs))
    assert got_colocated == want
    before = decode.stats()
    got, drafts = _logged(decode, lambda: _through_pd(prefill, decode, reqs))
    assert got == want
    assert decode.stats()["kv_transfer_fallbacks"] == before["kv_transfer_fallbacks"]
    assert _counts(decode, before)[0] > 0  # (random weights: few MTP drafts are accepted; all are compared)
    common = set(drafts) & set(ref)
    assert len(common) >= 0.9 * len(ref) > 0, (len(common), len(ref))
    assert {c: drafts[c] for c in common} == {c: ref[c] for c in common}

    # the behaviour before issue 35: the pulled MTP rows and carry not written -> other drafts
    monkeypatch.setattr(hooks, "write_mtp", lambda caches, *a, **kw: caches)
    stale_reqs = [EngineRequest(f"s{r.request_id}", r.prompt_token_ids, GREEDY) for r in reqs]
    got, stale = _logged(decode, lambda: _through_pd(prefill, decode, stale_reqs))
    assert got == {f"s{rid}": tokens for rid, tokens in want.items()}  # exact all the same
    common = set(stale) & set(ref)
    assert sum(stale[c] != ref[c] for c in common) > 0, "stale MTP rows went unnoticed"
    for engine in mtp_engines:
        _all_free(engine)


def test_mtp_decode_refuses_a_descriptor_without_mtp_state(mtp_engines):
    """A prefill peer that sends no MTP state (no MTP layer, or a mesh): the decode side refuses the
    descriptor by name and prefills locally (on_pull_failure: recompute): counted, exact, nothing leaked."""
    prefill, decode, _, off = mtp_engines
    reqs = _requests(decode.tokenizer, "n")[:2]
    want = _serve(off, reqs)

    def strip(desc):
        assert desc["mtp"]["hidden_dtype"] == "float32"
        arrays = [a for a in desc["arrays"] if not a[0].startswith("mtp.")]
        assert len(arrays) == len(desc["arrays"]) - 3  # mtp.k, mtp.v, mtp.hidden
        return {k: v for k, v in desc.items() if k != "mtp"} | {"arrays": arrays}

    before = decode.stats()["kv_transfer_fallbacks"]
    got = _through_pd(prefill, decode, reqs, strip)
    assert got == want
    assert decode.stats()["kv_transfer_fallbacks"] == before + len(reqs)

    def lie(desc):  # MTP arrays of the wrong width: a precise TransferError, not garbage
        arrays = [[n, [1, 7], d] if n == "mtp.hidden" else [n, s, d] for n, s, d in desc["arrays"]]
        return desc | {"arrays": arrays}

    got = _through_pd(prefill, decode, [EngineRequest("lie", reqs[0].prompt_token_ids, GREEDY)], lie)
    assert got == {"lie": want[reqs[0].request_id]}
    assert decode.stats()["kv_transfer_fallbacks"] == before + len(reqs) + 1
    for engine in mtp_engines:
        _all_free(engine)


def test_expected_mtp_arrays_name_the_difference(tiny_checkpoint):
    """The decode side's array check covers the MTP entries (layout.expected_arrays)."""
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.kv_transfer.base import TransferError
    from runtime.kv_transfer.spec_layout import check_drafter, expected_mtp

    cfg = parse_config(read_json(tiny_checkpoint("qwen3_5") / "config.json"))
    desc = {"kv_dtype": "bfloat16", "num_pages": 2, "page_size": 4, "mtp": {"hidden_dtype": "bfloat16"}}
    page = [2, cfg.num_kv_heads, 4, cfg.head_dim]
    assert expected_mtp(desc, cfg) == [
        ["mtp.k", page, "uint16"],
        ["mtp.v", page, "uint16"],
        ["mtp.hidden", [1, cfg.hidden_size], "uint16"],
    ]
    with pytest.raises(TransferError, match="descriptor field mtp"):
        expected_mtp(desc | {"mtp": {"hidden_dtype": "int8"}}, cfg)
    with pytest.raises(TransferError, match="sent no MTP state"):
        check_drafter({}, has_mtp=True)
    check_drafter({}, has_mtp=False)


# ---- method: draft_model (tiny Llama drafting for itself) ---------------------------------------
@pytest.mark.slow
def test_draft_model_on_decode_side_accepts_every_draft(plugin, tiny_checkpoint, monkeypatch):  # noqa: F811
    """The decode side computes the draft's K/V of the pulled tokens: a target drafting with itself
    has every draft accepted after the pull, output equal to no speculation; without that step
    (the draft's pages left as they were) drafts are rejected."""
    path = tiny_checkpoint("llama")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match="the prefill role computes prompts only"):
        _engine(path, spec, role="prefill")
    prefill = _engine(path, role="prefill", connector=plugin)
    decode = _engine(path, spec, role="decode", connector=plugin)
    off = _engine(path)
    reqs = _requests(decode.tokenizer, "d")
    want = _serve(off, reqs)
    before = decode.stats()
    assert _through_pd(prefill, decode, reqs) == want
    drafted, accepted = _counts(decode, before)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    assert decode.stats()["kv_transfer_fallbacks"] == 0

    monkeypatch.setattr(hooks, "recompute_draft", lambda params, cache, *a, **kw: cache)
    before = decode.stats()
    again = [EngineRequest(f"x{r.request_id}", r.prompt_token_ids, GREEDY) for r in reqs]
    assert _through_pd(prefill, decode, again) == {f"x{rid}": tokens for rid, tokens in want.items()}
    drafted, accepted = _counts(decode, before)
    assert accepted < drafted, "the draft's missing K/V went unnoticed"
    for engine in (prefill, decode, off):
        _all_free(engine)
