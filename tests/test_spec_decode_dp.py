"""Speculative decoding under attention data parallelism (issue 35): runtime/speculative/dp_verify.py.

One subprocess per family with 8 simulated CPU devices (like tests/test_data_parallel.py), mesh
(data 2, model 4): each rank's drafting sequences carry their drafts as extra query rows of that
rank's slice of the flat batch, acceptance is per sequence, a GDN hybrid replays its accepted
prefixes per rank. References, independent of the code under test: the one-device engine without
speculation, the same DP engine without speculation, and HF's greedy `generate`. Rounds:

- "g": copy-heavy prompts and their doubled versions (11 requests over both ranks, 34 pages per
  rank: chunked prefill and preemption), drafts accepted and rejected;
- "features": a logit bias, a `min_tokens` ban, logprobs, penalties, seeded sampling and a regex
  grammar (the per-sequence features and parameters of the verify rows, from the host under DP,
  and the grammar masks of the verify rows in the combined order);
- "idle": one request alone, so the other rank schedules nothing in every step;
- "isolation": two long requests sharing a prefix fill rank 0 (it preempts), rank 1 keeps serving
  a third one on its own pages.

Tiny Llama drafts with the real n-gram drafter (prompt lookup over copy-heavy prompts); the tiny
Qwen3.5 with `OracleDrafts` (the reference continuation with one draft spoiled: every accepted
count 0 .. k occurs, so the per-rank GDN replay is checked for each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import assert_greedy_match, hf_greedy

from configs.speculative import SpeculativeConfig
from runtime.speculative.dp_verify import rank_major, rank_spec_rows
from runtime.speculative.speculator import refusal, verify_rows

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, "tests")
from engine_testing import spec_engine
from test_spec_decode import SPEC, _greedy_requests
from test_spec_decode_gdn import OracleDrafts
from runtime.speculative import speculator
from runtime.types import EngineRequest, SamplingParams, StructuredOutput

path, oracle_drafts, crowd = sys.argv[1], sys.argv[2] == "oracle", sys.argv[3] == "crowd"
DP = dict(mesh_shape=(2, 4), num_pages=68)  # 34 pages of 4 per rank: 132 tokens

def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

def serve(engine, requests, before_rest=None, rest=()):
    # -> ({request id: tokens}, per step: each rank's scheduled sequences, drafting ones, ids with output)
    for r in requests:
        engine.add_request(r)
    tokens, steps, placed = {}, [], dict(getattr(engine.scheduler, "rank_of", {}))
    while engine.has_unfinished():
        if before_rest is not None and len(steps) == before_rest:
            for r in rest:
                engine.add_request(r)
            placed.update(getattr(engine.scheduler, "rank_of", {}))
        outputs, out = engine.schedule()
        pending, failure = engine.run(out)
        outputs += engine.postprocess(out, pending, failure)
        engine.scheduler.check_invariants()
        ranks = getattr(out, "ranks", [out])
        steps.append(([len(o.sequences) for o in ranks], [sum(bool(s.num_draft) for s in o.sequences) for o in ranks],
                      sorted(o.request_id for o in outputs if o.new_token_ids)))
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_logprobs:
                LOGPROBS.setdefault(id(engine), {}).setdefault(o.request_id, []).extend(t.logprob for t in o.new_logprobs)
    s = engine.stats()
    assert s["pages_used"] == 0 and s["slots_used"] == 0 and s["num_running"] == 0, s  # no leaks
    assert not getattr(engine.scheduler, "rank_of", {}), engine.scheduler.rank_of  # every placement gone
    return tokens, steps, placed

one = spec_engine(path, None)
off = spec_engine(path, None, **DP)
spec = spec_engine(path, {**SPEC, "disable_by_batch_size": 2} if crowd else SPEC, **DP)  # crowd: 4 over both ranks
oracle = OracleDrafts(spec.model.cfg.vocab_size)
if oracle_drafts:
    speculator.propose_ngram = oracle
tok = spec.tokenizer
report, LOGPROBS = {}, {}

def round_(name, requests, before_rest=None, rest=()):
    ref, _, _ = serve(one, list(requests) + list(rest))
    for r in list(requests) + list(rest):
        oracle.add(r.prompt_token_ids, ref[r.request_id])
    dp_off, _, _ = serve(off, requests, before_rest, rest)
    before = spec.stats()
    preempted = [s.num_preemptions for s in spec.scheduler.ranks]
    got, steps, placed = serve(spec, requests, before_rest, rest)
    report[name] = {"one": ref, "dp_off": dp_off, "got": got, "steps": steps, "before": before, "after": spec.stats(),
                    "placed": placed, "prompts": {r.request_id: r.prompt_token_ids for r in list(requests) + list(rest)},
                    "preempted": [s.num_preemptions - p for s, p in zip(spec.scheduler.ranks, preempted)]}

round_("g", _greedy_requests(tok, "g"))
if crowd:
    print("REPORT " + json.dumps(report))
    sys.exit(0)
first = report["g"]["one"]["g0"]
copy = "a b c d a b c d a b c d a b"
features = {"bias": dict(logit_bias={first[2]: -100.0}), "ban": dict(min_tokens=10, stop_token_ids=[first[1]]),
            "logprobs": dict(logprobs=2), "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.2)}
round_("features", [EngineRequest(f"f-{k}", tok.encode(copy), SamplingParams(max_tokens=16, temperature=0.0, **v))
                    for k, v in features.items()]
       + [EngineRequest("f-seeded", tok.encode(copy * 2), SamplingParams(max_tokens=16, temperature=0.8, seed=7)),
          EngineRequest("f-grammar", tok.encode(copy), SamplingParams(max_tokens=16, temperature=0.0,
                        structured_output=StructuredOutput("regex", r"( ?[a-d])+")))])
report["features"]["logprobs"] = {k: LOGPROBS.get(id(e), {}).get("f-logprobs") for k, e in (("one", one), ("got", spec))}
round_("idle", [EngineRequest("solo", tok.encode("a b c d a b c d a b c d a b"), greedy(24))])
prompt = list(range(3, 27)) * 2  # 48 tokens, 12 full pages: b follows a's prefix to rank 0
round_("isolation", [EngineRequest("a", prompt + [60], greedy(60)), EngineRequest("s", [7, 8, 9, 7, 8, 9], greedy(40))],
       before_rest=2, rest=[EngineRequest("b", prompt + [61], greedy(60))])
print("REPORT " + json.dumps(report))
"""


def _run(path, oracle: bool, crowd: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), "oracle" if oracle else "ngram", "crowd" if crowd else "-"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("REPORT ") :])


@pytest.fixture(scope="module")
def reports(tiny_checkpoint):
    built = {}

    def get(family):
        if family not in built:
            built[family] = _run(tiny_checkpoint(family), oracle=family != "llama")
        return built[family]

    return get


FAMILIES = ["llama", pytest.param("qwen3_5", marks=pytest.mark.slow)]


def _delta(case, key):
    return case["after"][key] - case["before"][key]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_dp_and_one_device_without_speculation_and_hf(family, reports, hf_model):
    report = reports(family)
    for name, case in report.items():
        assert case["got"] == case["dp_off"] == case["one"], name
    g = report["g"]
    assert all(len(t) == 20 for t in g["got"].values()) and len(g["got"]) == 11
    drafted, accepted = _delta(g, "spec_decode_num_draft_tokens"), _delta(g, "spec_decode_num_accepted_tokens")
    assert 0 < accepted < drafted, g["after"]  # drafts both accepted and rejected
    assert _delta(g, "num_preemptions") > 0, g["after"]
    if family != "llama":  # the oracle's drafts: every accepted count occurs, all k included
        assert g["after"]["spec_decode_num_accepted_tokens_per_pos"][-1] > 0, g["after"]
    hf = hf_model(family)
    for name, rid in (("idle", "solo"), ("g", "g0"), ("g", "g1"), ("g", "g2")):
        got = report[name]["got"][rid]
        expected, scores = hf_greedy(hf, report[name]["prompts"][rid], len(got))
        assert_greedy_match(got, expected, scores, f"{family} {rid}")


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_features_compose(family, reports):
    case = reports(family)["features"]
    assert case["got"] == case["dp_off"] == case["one"]
    assert _delta(case, "spec_decode_num_accepted_tokens") > 0, case["after"]
    got, want = case["logprobs"]["got"], case["logprobs"]["one"]
    assert len(got) == len(want) == 16 and max(abs(a - b) for a, b in zip(got, want)) < 1e-3, (got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_spread_over_ranks_and_counters_sum_over_them(family, reports):
    g = reports(family)["g"]
    assert sorted(set(g["placed"].values())) == [0, 1], g["placed"]
    assert any(min(n) > 0 and min(d) > 0 for n, d, _ in g["steps"]), "no step verified drafts on both ranks"
    for name in ("draft", "accepted"):
        per_rank = [_delta(g, f"dp_rank{r}_spec_decode_num_{name}_tokens") for r in (0, 1)]
        assert sum(per_rank) == _delta(g, f"spec_decode_num_{name}_tokens") and min(per_rank) >= 0, g["after"]
    assert min(_delta(g, f"dp_rank{r}_spec_decode_num_draft_tokens") for r in (0, 1)) > 0, g["after"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rank_with_nothing_scheduled_verifies_the_others_drafts(family, reports):
    idle = reports(family)["idle"]
    busy = idle["placed"]["solo"]
    assert all(n[1 - busy] == 0 for n, _, _ in idle["steps"]), idle["steps"]  # the other rank never schedules
    assert sum(d[busy] for _, d, _ in idle["steps"]) > 0, "no verify step"
    assert _delta(idle, f"dp_rank{busy}_spec_decode_num_draft_tokens") > 0
    assert _delta(idle, f"dp_rank{1 - busy}_spec_decode_num_draft_tokens") == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_on_one_rank_while_the_other_keeps_serving(family, reports):
    case = reports(family)["isolation"]
    assert case["placed"] == {"a": 0, "s": 1, "b": 0}, case["placed"]  # b follows a's prefix to rank 0
    assert case["preempted"][0] > 0 and case["preempted"][1] == 0, case["preempted"]
    served = [("s" in ids) for _, _, ids in case["steps"]]
    first, last = served.index(True), len(served) - 1 - served[::-1].index(True)
    assert all(served[first : last + 1]), "rank 1's request skipped a step while rank 0 preempted"
    assert _delta(case, "spec_decode_num_draft_tokens") > 0


@pytest.mark.slow
def test_disable_by_batch_size_holds_per_rank(tiny_checkpoint):
    """`disable_by_batch_size: 2` on two ranks: no drafts while more than 4 requests decode (those
    steps keep asynchronous scheduling, their placeholders fed from the step in flight), drafts
    again as requests finish; outputs unchanged."""
    g = _run(tiny_checkpoint("llama"), oracle=True, crowd=True)["g"]
    assert g["got"] == g["dp_off"] == g["one"]
    assert _delta(g, "spec_decode_num_disabled_steps") > 0 and _delta(g, "spec_decode_num_accepted_tokens") > 0
    # drafting requests decode: at most 4, and more than one rank's 2 (the rule is per rank, not over all)
    assert 2 < max(sum(d) for _, d, _ in g["steps"]) <= 4, g["steps"]


# ---- device-free: the verify layout and the refusals --------------------------------------------------
def _seq(n_new, k, outputs=0):
    request = SimpleNamespace(num_output_tokens=outputs)
    return SimpleNamespace(num_new_tokens=n_new, num_draft=k, token_ids=list(range(100, 100 + n_new)), request=request)


def test_verify_rows_are_each_ranks_own_token_rows_in_the_combined_order():
    # rank 0: a 5-token prefill chunk, then a decode with 2 drafts; rank 1: a decode with 3 drafts
    ranks = [SimpleNamespace(sequences=[_seq(5, 0), _seq(3, 2, outputs=4)]), SimpleNamespace(sequences=[_seq(4, 3)])]
    out = SimpleNamespace(ranks=ranks, sequences=ranks[0].sequences + ranks[1].sequences)
    verify, first = verify_rows(out, T=32, S=8)  # two ranks of 16 token rows, 4 sequence rows each
    n = 1 + 3 + 4
    assert verify.rows[:n].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert verify.seqs[:n].tolist() == [0, 1, 1, 1, 2, 2, 2, 2] and (verify.seqs[n:] == -1).all()
    assert verify.offsets[:n].tolist() == [0, 0, 1, 2, 0, 1, 2, 3]
    assert verify.steps[:n].tolist() == [0, 4, 5, 6, 0, 1, 2, 3]
    assert verify.drafts[:n].tolist() == [-1, 101, 102, -1, 101, 102, 103, -1]
    assert verify.num_draft[:3].tolist() == [0, 2, 3] and first[:3].tolist() == [0, 1, 4]
    # the GDN side: rank-local batch positions (rank r's sequence i at r * 4 + i), rank-local rows
    num_seqs = jnp.array([2, 1], jnp.int32)
    spec = np.asarray(rank_spec_rows(jax.tree.map(jnp.asarray, verify), num_seqs, 4, 16))
    expected = np.full((8, 4), -1)
    expected[0, 0], expected[1, :3], expected[4, :] = 4, [5, 6, 7], [0, 1, 2, 3]
    np.testing.assert_array_equal(spec, expected)
    accepted = jnp.array([0, 2, 1, 0, 0, 0, 0, 0], jnp.int32)  # by combined index
    np.testing.assert_array_equal(np.asarray(rank_major(accepted, num_seqs, 4)), [[0, 2, 0, 0], [1, 0, 0, 0]])


def test_what_attention_dp_refuses_is_named():
    def engine(method, dp=True):
        cfg = SimpleNamespace(kda=False, layer_types=("full_attention",))
        config = SimpleNamespace(speculative_config=SpeculativeConfig(method=method), kv_transfer=None)
        dp = SimpleNamespace(size=2) if dp else None
        return SimpleNamespace(model=SimpleNamespace(cfg=cfg), config=config, dp=dp,
                               executables=SimpleNamespace(window_paging=False))  # fmt: skip

    assert refusal(engine("ngram")) is None and refusal(engine("mtp", dp=False)) is None
    assert refusal(engine("mtp")) == ("method 'mtp' under attention data parallelism is not supported yet (ngram is)")
