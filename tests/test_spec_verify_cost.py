"""benchmarks/spec_verify_cost.py (issue 35's device check, validated on CPU): the break-even
formula, and the `--dry-run` path end to end on the tiny Qwen3.5 with its MTP layer (the decode
and verify steps captured from a real engine step and replayed; the oracle-draft rows accept
every draft and produce the plain engine's text)."""

from __future__ import annotations

import json

import pytest

from benchmarks.spec_verify_cost import break_even_alpha, main


@pytest.mark.parametrize(("a_star", "k", "alpha"), [(0.75, 2, 0.5), (0.3, 1, 0.3), (0.9375, 4, 0.5), (0.0, 2, 0.0)])
def test_break_even_alpha_solves_the_geometric_sum(a_star, k, alpha):
    # by hand: 0.5 + 0.25 = 0.75; 0.5 + 0.25 + 0.125 + 0.0625 = 0.9375
    assert break_even_alpha(a_star, k) == pytest.approx(alpha, abs=1e-9)


def test_break_even_past_k_never_pays():
    assert break_even_alpha(4.0, 4) is None and break_even_alpha(7.5, 2) is None


@pytest.mark.slow  # 14-26 s each on the shared 2-core CPU: two engines, five compiled steps
@pytest.mark.parametrize(
    ("fuse", "plain_calls"), [("on", "run_table_greedy_backbone"), ("off", "run_table_backbone+run_sampler")]
)
def test_dry_run_captures_and_replays_both_steps(tmp_path, fuse, plain_calls):
    path = tmp_path / "cost.json"
    args = ["--shape", "tiny", "--dry-run", "--fuse-greedy", fuse, "--e2e-max-batch", "1", "--e2e-tokens", "12"]
    main([*args, "--json", str(path)])
    report = json.loads(path.read_text())
    (row,) = report["rows"]
    plain, verify = row["plain"], row["mtp_k1"]
    assert row["batch"] == 1 and report["ks"] == [1] and report["repeats"] == 1
    assert plain["calls"] == plain_calls and report["complete"] is True
    assert verify["calls"] == "run"  # the verify executable: MTP drafts, k + 1 rows, acceptance in one step
    assert len(plain["times_s"]) == len(verify["times_s"]) == 1 and plain["median_s"] > 0
    assert verify["ratio_median"] == pytest.approx(verify["median_s"] / plain["median_s"])
    assert verify["break_even_accepted_per_step"] == pytest.approx(verify["ratio_median"] - 1)
    # oracle drafts (the plain engine's own greedy output): every draft accepted, the same text
    assert verify["e2e_identical_text"] is True and verify["e2e_accepted_per_draft"] == 1.0
