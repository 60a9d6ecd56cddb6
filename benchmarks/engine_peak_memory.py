"""The CPU engine's peak memory and saturation throughput, before and after the caches in place (issue 32).

    git worktree add /tmp/before 2783b10          # BEFORE_COMMIT
    python -m benchmarks.engine_peak_memory       # -> benchmarks/results/cache-copies/engine-peak-memory-cpu-2core.json
    python -m benchmarks.engine_peak_memory --models qwen3_5 --requests 8 --repeats 1 --json /tmp/p.json   # quick

"before" is the tree at BEFORE_COMMIT, the commit before the in-place caches work began (its child
6b97292 writes KV pages back by dynamic-update-slice instead of scattering into the pool; found
with `git log --oneline -- pallas_kernels/kv_write.py runtime/steps`), checked out with
`git worktree add`; "after" is this tree. Every (model, tree) runs the same child invocation in
a fresh process with PYTHONPATH set to that tree, so `runtime`, `models` and the throughput
helpers (`benchmarks.throughput.run_ours`, `benchmarks.workloads.make_workload`) are that tree's.
The child builds `LLM(...)` with the same arguments (executables compiled ahead of time) and
reports:

- peak RSS (the kernel's VmHWM) after start-up (weights, caches, compiled steps) and after the runs:
  a step that copied its caches would raise the second by about the pool's size;
- per compiled executable, XLA's memory analysis: argument, output, alias and temp bytes;
- saturation throughput: `--requests` requests of the `fixed` workload (more than `max_num_seqs`,
  so the batch stays full) through `LLM.generate`, greedy, output tokens/s, median of `--repeats`
  after one warm-up; and a digest of the greedy tokens, equal before and after when exact.

Models: the tiny Qwen3.5-style hybrid (benchmarks/tiny_checkpoints.py) and SmolLM2-135M-Instruct,
the default model (models/default_model.py's GGUF under ~/.cache/jaxserve), both float32 as
configs/cpu-demo.yaml serves. Runs alternate before/after per model (the machine's load drifts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "2783b10"
DEFAULT_JSON = REPO / "benchmarks" / "results" / "cache-copies" / "engine-peak-memory-cpu-2core.json"
# configs/cpu-demo.yaml's pool and budget
ENGINE = dict(
    dtype="float32",
    page_size=16,
    num_pages=512,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_model_len=2048,
    aot_compile=True,
    seed=0,
)


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(args) -> dict:
    """One engine in this process, from whatever tree PYTHONPATH names."""
    import jax
    import numpy as np

    from benchmarks.throughput import run_ours
    from benchmarks.workloads import make_workload
    from runtime.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, **ENGINE)
    startup_s = time.perf_counter() - t0
    rss_startup = vm_hwm_bytes()
    engine = llm.engine
    requests = make_workload(
        "fixed",
        vocab_size=engine.model.cfg.vocab_size,
        seed=0,
        num_requests=args.requests,
        scale=args.scale,
        max_model_len=ENGINE["max_model_len"],
    )
    run_ours(llm, requests[:2])  # warm-up: first-use sampler variants
    runs = [run_ours(llm, requests) for _ in range(args.repeats)]
    rss_end = vm_hwm_bytes()
    executables = {}
    for key, exe in engine.executables.executables.items():
        mem = exe.memory_analysis()
        executables[key.name] = {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
        }
    backbones = {k: v for k, v in executables.items() if "backbone" in k}
    tokens = runs[0]["tokens"]
    return {
        "jax": jax.__version__,
        "startup_s": round(startup_s, 1),
        "cache_bytes": int(sum(x.nbytes for x in jax.tree.leaves(engine.caches))),
        "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(engine.model.params))),
        "peak_rss_after_startup_bytes": rss_startup,
        "peak_rss_bytes": rss_end,
        "output_tokens_per_s": [round(r["output_tokens_per_s"], 2) for r in runs],
        "median_output_tokens_per_s": round(float(np.median([r["output_tokens_per_s"] for r in runs])), 2),
        "output_tokens": int(sum(map(len, tokens))),
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        "max_backbone_temp_bytes": max((v["temp_bytes"] for v in backbones.values()), default=0),
        "max_backbone_alias_bytes": max((v["alias_bytes"] for v in backbones.values()), default=0),
        "executables": executables,
    }


def run_child(tree: Path, model: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model]
    command += ["--requests", str(args.requests), "--scale", str(args.scale), "--repeats", str(args.repeats)]
    t0 = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child for {model} in {tree} failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-tree", default="/tmp/before", help=f"a checkout of {BEFORE_COMMIT}")
    parser.add_argument("--models", default="qwen3_5,smollm2", help="qwen3_5 (tiny hybrid), smollm2 (default model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--scale", type=float, default=0.5, help="fixed workload: 128 x scale tokens in and out")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    before = Path(args.before_tree)
    if not (before / "runtime").is_dir():
        parser.error(f"{before}: not a checkout; run `git worktree add {before} {BEFORE_COMMIT}` first")
    commit = subprocess.run(["git", "-C", str(before), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    from benchmarks.tiny_checkpoints import build_cached_checkpoint
    from models.default_model import ensure_default_model

    paths = {"qwen3_5": str(build_cached_checkpoint("qwen3_5")), "smollm2": str(ensure_default_model())}
    results = []
    for name in args.models.split(","):
        row = {"model": name, "path": paths[name]}
        for label, tree in (("before", before), ("after", REPO)):
            row[label] = run_child(tree, paths[name], args)
            r = row[label]
            print(
                f"{name:8s} {label:6s} peak RSS {gib(r['peak_rss_bytes'])} (after start-up "
                f"{gib(r['peak_rss_after_startup_bytes'])}), caches {gib(r['cache_bytes'])}, largest backbone temp "
                f"{gib(r['max_backbone_temp_bytes'])}, {r['median_output_tokens_per_s']} tok/s",
                flush=True,
            )
        row["same_tokens"] = row["before"]["tokens_sha256"] == row["after"]["tokens_sha256"]
        results.append(row)
    out = {
        "what": "CPU engine peak RSS, compiled steps' memory analysis and saturation throughput, before/after issue 32's caches in place",
        "command": "python -m benchmarks.engine_peak_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
        "before_commit": commit.strip(),
        "after_commit": head.strip() + " (+ the working tree)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (the 2-core CPU box, shared)",
        "engine": ENGINE,
        "workload": {"name": "fixed", "scale": args.scale, "requests": args.requests, "repeats": args.repeats},
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
