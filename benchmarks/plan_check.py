"""Check the committed `jaxserve plan --json` files of the shipped TPU configs (issue 32).

    python -m benchmarks.plan_check [--dir benchmarks/results/plan]      # exit 1 naming each failure

Every `configs/tpu-*.yaml` must have its plan JSON under `--dir` (`<config stem>.json`), written from
the config as it is now (max_num_seqs, page size, memory fraction and mesh equal the YAML's), that
fits, and whose largest per-device temp over its compiled executables is at most `MAX_TEMP_FRACTION`
of the device's KV + GDN state bytes (a step that copies its caches shows a temp >= 100 %). The two
main configs must serve at least `MIN_SEQS` sequences (per DP rank). Reads JSON only: no compile.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PLAN_DIR = REPO_ROOT / "benchmarks" / "results" / "plan"
CONFIG_DIR = REPO_ROOT / "configs"
MAX_TEMP_FRACTION = 0.15
# config stem -> sequences it must serve (issue 32: twice what they served before, 32 and 128)
MIN_SEQS = {"tpu-v5e-8-qwen3_5-27b": 64, "tpu-v5p-16-qwen3-next-80b-multihost": 256}


def shipped_tpu_configs(config_dir: Path = CONFIG_DIR) -> list[Path]:
    return sorted(config_dir.glob("tpu-*.yaml"))


def max_temp(plan: dict) -> tuple[str, int]:
    """(executable name, temp bytes) of the compiled executable with the largest temp."""
    compiled = [e for e in plan["executables"] if e["temp_bytes"] is not None]
    if not compiled:
        raise ValueError(f"{plan['config']}: no compiled executable (a GPU plan has no temp)")
    worst = max(compiled, key=lambda e: e["temp_bytes"])
    return worst["name"], worst["temp_bytes"]


def check_plan(plan: dict, launch, stem: str) -> list[str]:
    """The failures of one plan JSON against its launch config (empty: passes)."""
    problems = []
    expected = {
        "max_num_seqs": launch.scheduler.max_num_seqs,
        "page_size": launch.cache.page_size,
        "memory_fraction": launch.cache.memory_fraction,
        "mesh": {"data": launch.parallel.mesh.data, "model": launch.parallel.mesh.model},
        "chip": launch.parallel.chip,
    }
    for key, want in expected.items():
        if plan.get(key) != want:
            problems.append(f"{stem}: {key} is {plan.get(key)!r} in the JSON, {want!r} in the config (re-plan it)")
    if not plan["fits"]:
        problems.append(f"{stem}: does not fit: {'; '.join(plan['problems'])}")
    name, temp = max_temp(plan)
    caches = plan["kv_cache_bytes"] + plan["state_bytes"]
    if temp > MAX_TEMP_FRACTION * caches:
        problems.append(
            f"{stem}: {name} temp {temp / 2**30:.2f} GiB = {temp / caches:.1%} of KV + state "
            f"({caches / 2**30:.2f} GiB) > {MAX_TEMP_FRACTION:.0%}"
        )
    need = MIN_SEQS.get(stem)
    if need is not None and plan["max_num_seqs"] < need:
        problems.append(f"{stem}: serves {plan['max_num_seqs']} sequences, needs >= {need}")
    return problems


def check_all(plan_dir: Path = PLAN_DIR, config_dir: Path = CONFIG_DIR) -> tuple[list[dict], list[str]]:
    """(one summary row per shipped TPU config, every failure)."""
    from configs.schema import load_config

    rows, problems = [], []
    for config in shipped_tpu_configs(config_dir):
        path = plan_dir / f"{config.stem}.json"
        if not path.is_file():
            rel = lambda p: p.relative_to(REPO_ROOT) if p.is_relative_to(REPO_ROOT) else p
            problems.append(f"{config.stem}: no plan JSON (jaxserve plan --config {rel(config)} --json {rel(path)})")
            continue
        plan = json.loads(path.read_text())
        found = check_plan(plan, load_config(config), config.stem)
        problems += found
        name, temp = max_temp(plan)
        caches = plan["kv_cache_bytes"] + plan["state_bytes"]
        rows.append(
            {
                "config": config.stem,
                "max_num_seqs": plan["max_num_seqs"],
                "kv_gib": plan["kv_cache_bytes"] / 2**30,
                "state_gib": plan["state_bytes"] / 2**30,
                "max_temp_executable": name,
                "max_temp_gib": temp / 2**30,
                "temp_over_caches": temp / caches,
                "peak_gib": max(e["peak_bytes"] for e in plan["executables"]) / 2**30,
                "buckets": [e["name"] for e in plan["executables"]],
                "ok": not found,
            }
        )
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=PLAN_DIR, help="where the plan JSON files are")
    args = parser.parse_args(argv)
    rows, problems = check_all(args.dir)
    print(f"{'config':<40}{'seqs':>6}{'KV':>9}{'state':>9}{'max temp':>10}{'temp/(KV+state)':>17}{'peak':>9}")
    for r in rows:
        print(
            f"{r['config']:<40}{r['max_num_seqs']:>6}{r['kv_gib']:>8.2f}G{r['state_gib']:>8.2f}G"
            f"{r['max_temp_gib']:>9.2f}G{r['temp_over_caches']:>17.1%}{r['peak_gib']:>8.2f}G  ({r['max_temp_executable']})"
        )
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
