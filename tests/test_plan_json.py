"""`jaxserve plan --json PATH`: the JSON is the report's figures, and those are the compiler's.

One real libtpu compile (a tiny random Qwen3.5 on one v5e chip, decode bucket 16, ~20 s): the JSON
written by the CLI is compared field by field with the `PlanReport` the CLI built, its weights with
the loaded checkpoint's own bytes, and one executable's memory with `memory_analysis()` of the same
step compiled here, independently of the planner.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json

import jax

from configs import CONFIG_DIR, load_config
from models.abstract import abstract_caches, abstract_model, shard_abstract_model
from models.config import parse_config
from models.model import load_model
from models.ops import KernelOptions
from models.safetensors_io import read_json
from runtime.aot import chip_report
from runtime.steps.executables import StepExecutables, StepKey
from runtime.steps.execution_plan import plan_buckets
from server.cli import main

CONFIG = CONFIG_DIR / "tpu-v5e-8-qwen3_5-27b.yaml"


def _one_chip(path) -> dict:
    return {
        "model.path": str(path),
        "parallel.chip": "tpu-v5e",
        "parallel.topology": "1x1",
        "parallel.mesh.model": 1,
        "scheduler.max_num_seqs": 32,
    }


def test_plan_json_is_the_report_and_the_compilers_figures(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    path = tiny_checkpoint("qwen3_5")
    overrides = _one_chip(path)
    reports = []
    real = chip_report.plan_config

    def spy(*args, **kwargs):
        reports.append(real(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(chip_report, "plan_config", spy)
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", str(CONFIG), "--buckets", "16", "--json", str(out)]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "executable" in stdout and "fits: yes" in stdout  # the human table stays on stdout
    data = json.loads(out.read_text())
    (r,) = reports

    assert data["chip"] == "tpu-v5e" and data["num_devices"] == 1 and data["mesh"] == {"data": 1, "model": 1}
    assert data["max_num_seqs"] == r.max_num_seqs == 32  # the override's
    assert (data["kv_cache_bytes"], data["state_bytes"], data["weight_bytes"]) == (
        r.kv_bytes,
        r.state_bytes,
        r.weight_bytes,
    )
    assert (data["num_pages"], data["page_size"], data["num_state_slots"]) == (
        r.num_pages,
        r.page_size,
        r.num_state_slots,
    )
    assert data["checkpoints"]["num_slots"] == r.num_checkpoint_slots
    assert data["checkpoints"]["budget_bytes"] == r.checkpoint_budget_bytes
    # the weights: the real checkpoint's bytes in the config's dtype (bf16), read by the real loader
    loaded = load_model(path, dtype="bfloat16").params
    assert data["weight_bytes"] == sum(x.nbytes for x in jax.tree.leaves(loaded))
    # the KV pool: at least its FP8 values (2 x layers x KV heads x head_dim bytes a token)
    cfg = parse_config(read_json(path / "config.json"))
    per_token = 2 * cfg.num_attention_layers * cfg.num_kv_heads * cfg.head_dim
    assert data["kv_bytes_per_token"] == per_token
    assert data["num_pages"] * data["page_size"] * per_token <= data["kv_cache_bytes"]

    assert [e["name"] for e in data["executables"]] == [s.name for s in r.steps] == ["backbone[T=16]", "sampler[S=32]"]
    keys = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "flops", "bytes_accessed")
    for entry, step in zip(data["executables"], r.steps):
        assert {k: entry[k] for k in keys} == {k: getattr(step, k) for k in keys}
        assert entry["peak_bytes"] == (
            entry["argument_bytes"] + entry["output_bytes"] - entry["alias_bytes"] + entry["temp_bytes"]
        )
    assert data["executables"][0]["flops"] > 0  # the CLI compiles the cost

    # the roofline: the lines the table prints, with the report's numbers
    assert [f["kind"] for f in data["roofline"]] == ["decode", "prefill"]
    for f in data["roofline"]:
        assert f["line"] in stdout
        expected = r.roofline(f["kind"])
        assert {k: f[k] for k in expected} == expected

    # the decode backbone compiled here, for the same chip, pool and slots, without the planner
    launch = load_config(CONFIG, overrides)
    model = abstract_model(cfg, "bfloat16", str(path))
    shard_abstract_model(model, chip_report.target_mesh(launch), False)
    # pages stored token-minor [P, Hkv, D, ps] on TPU when head_dim < 128 and pages are whole 128-lane rows
    token_minor = cfg.head_dim < 128 and data["page_size"] % 128 == 0
    assert data["kv_token_minor"] == token_minor
    caches = abstract_caches(
        model, data["num_pages"], data["page_size"], data["num_state_slots"], "fp8_e4m3", token_minor=token_minor
    )
    _, seq_buckets = plan_buckets(4096, 32, None, "tpu")
    exes = StepExecutables(
        model,
        caches,
        KernelOptions(attention="pallas_tpu", gdn="pallas_tpu", tp=model.tp),
        token_buckets=(16,),
        seq_buckets=seq_buckets,
        max_num_seqs=32,
        max_blocks_per_seq=-(-data["max_model_len"] // 128),
    )
    mem = exes.compile(StepKey("backbone", 16)).memory_analysis()
    backbone = data["executables"][0]
    assert backbone["temp_bytes"] == mem.temp_size_in_bytes
    assert backbone["argument_bytes"] == mem.argument_size_in_bytes
    assert backbone["alias_bytes"] == mem.alias_size_in_bytes


def test_plan_json_into_a_missing_directory_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chip_report, "plan_config", lambda *a, **k: (_ for _ in ()).throw(AssertionError("planned")))
    target = tmp_path / "no-such-dir" / "plan.json"
    assert main(["plan", "--config", str(CONFIG), "--json", str(target)]) == 2
    assert f"--json {target}: its directory does not exist" in capsys.readouterr().err
    assert not target.exists()
