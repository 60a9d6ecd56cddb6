"""The committed `jaxserve plan --json` files of the shipped TPU configs (benchmarks/plan_check.py):
one per configs/tpu-*.yaml, planned from the config as it is, fitting, with the largest temp at
most 15 % of KV + state and the two main configs serving >= 64 and >= 256 sequences. No compile:
the JSON files are libtpu's figures, re-made with `jaxserve plan --json` when a config changes."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks.plan_check import MAX_TEMP_FRACTION, MIN_SEQS, PLAN_DIR, check_all, check_plan, shipped_tpu_configs
from configs.schema import load_config


def test_every_shipped_tpu_config_has_a_plan_within_the_temp_limit():
    rows, problems = check_all()
    assert not problems, "\n".join(problems)
    assert {r["config"] for r in rows} == {c.stem for c in shipped_tpu_configs()}
    assert all(r["temp_over_caches"] <= MAX_TEMP_FRACTION for r in rows)
    served = {r["config"]: r["max_num_seqs"] for r in rows}
    assert all(served[name] >= need for name, need in MIN_SEQS.items())


@pytest.mark.parametrize(
    "change,complaint",
    [
        (lambda p: p["executables"][0].update(temp_bytes=p["kv_cache_bytes"]), "of KV + state"),
        (lambda p: p.update(max_num_seqs=32), "max_num_seqs is 32 in the JSON"),
        (lambda p: p.update(fits=False, problems=["HLO temporaries exceed HBM"]), "does not fit"),
    ],
    ids=["temp-is-a-pool-copy", "stale-json", "unfit"],
)
def test_the_check_catches_a_copy_a_stale_plan_and_an_unfit_one(change, complaint):
    name = "tpu-v5e-8-qwen3_5-27b"
    plan = copy.deepcopy(json.loads((PLAN_DIR / f"{name}.json").read_text()))
    launch = load_config(next(c for c in shipped_tpu_configs() if c.stem == name))
    assert check_plan(plan, launch, name) == []
    change(plan)
    assert any(complaint in p for p in check_plan(plan, launch, name))
