"""Compare two lm-evaluation-harness runs item by item (loglikelihoods and task metrics).

    python -m benchmarks.lm_eval_compare OUT_JAXSERVE OUT_HF [--tol 1e-4]

Each OUT is an lm-eval `--output_path` directory written with `--log_samples`. For every task
in both, the script pairs the samples by (doc_id, request index), prints the largest absolute
difference of their loglikelihoods and both runs' metrics, and exits 1 if any difference
exceeds `--tol` or a metric differs by more than it. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _numbers(value) -> list[float]:
    """The loglikelihoods inside an lm-eval `resps` entry ([[ll, is_greedy]], [[ll]], strings...)."""
    if isinstance(value, bool) or value in ("True", "False"):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        try:
            return [float(value)]
        except ValueError:
            return []
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _numbers(item)]
    return []


def load_samples(out_dir: Path) -> dict[str, dict[tuple[int, int], float]]:
    """{task: {(doc_id, request index): loglikelihood}} from every samples_*.jsonl under out_dir."""
    tasks: dict[str, dict[tuple[int, int], float]] = {}
    for path in sorted(out_dir.rglob("samples_*.jsonl")):
        task = path.stem.removeprefix("samples_").rsplit("_", 1)[0]
        items = tasks.setdefault(task, {})
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            for index, resp in enumerate(sample["resps"]):
                values = _numbers(resp)
                if values:
                    items[(sample["doc_id"], index)] = values[0]
    return tasks


def load_metrics(out_dir: Path) -> dict[str, dict[str, float]]:
    metrics: dict[str, dict[str, float]] = {}
    for path in sorted(out_dir.rglob("results_*.json")):
        for task, values in json.loads(path.read_text())["results"].items():
            metrics[task] = {k: v for k, v in values.items() if isinstance(v, (int, float)) and "stderr" not in k}
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_eval_compare", description=__doc__.split("\n")[0])
    parser.add_argument("ours", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--tol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    ours, ref = load_samples(args.ours), load_samples(args.reference)
    ours_metrics, ref_metrics = load_metrics(args.ours), load_metrics(args.reference)
    ok = True
    print("| task | items | max abs diff of loglikelihood | metric | jaxserve | hf |")
    print("|---|---|---|---|---|---|")
    for task in sorted(set(ours) & set(ref)):
        keys = sorted(set(ours[task]) & set(ref[task]))
        if len(keys) != len(ref[task]) or not keys:
            print(f"{task}: {len(keys)} paired items of {len(ref[task])}", file=sys.stderr)
            ok = False
        diff = max((abs(ours[task][k] - ref[task][k]) for k in keys), default=float("nan"))
        ok &= diff <= args.tol
        for metric, value in sorted(ref_metrics.get(task, {}).items()):
            mine = ours_metrics.get(task, {}).get(metric, float("nan"))
            ok &= abs(mine - value) <= max(args.tol, args.tol * abs(value))
            print(f"| {task} | {len(keys)} | {diff:.2e} | {metric} | {mine:.6g} | {value:.6g} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
