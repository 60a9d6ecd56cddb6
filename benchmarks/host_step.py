"""Host time per engine step: the device-resident request table vs the host-built batch.

    python -m benchmarks.host_step .cache/peers/tiny-llama --trees main=/work/main table=. \
        --seqs 16 64 --repeats 3 --json benchmarks/results/cpu-2core-request-table/host_step.json
    python -m benchmarks.host_step .cache/peers/tiny-llama --trees table=. --seqs 64 --profile out.txt

The parent spawns one child process per (repeat, seqs, tree), the trees alternated within each
repeat (main, table, main, table, ...) so that load on a shared machine hurts both alike; each
child runs with `PYTHONPATH=<tree>`, builds one engine (max_num_seqs = seqs, greedy, no prefix
cache), serves each workload once untimed (warm-up) and once timed, and prints its numbers as
JSON. Workloads, `seqs` requests added at once:
  decode   prompt 16, output 96 tokens each (decode-heavy: most steps are `seqs` decodes)
  mixed    `benchmarks.workloads` "mixed" at scale 0.25 (long-tailed prompts and outputs)
  arrivals 8 x `seqs` "mixed" requests, closed loop: a new one as soon as one finishes, at most
           `seqs` in flight (what a server at saturation sees: prefill chunks of every size
           padded up to their token bucket, with decodes riding along)

Per step (timers wrapped around the engine's own methods, so both trees are measured alike):
  step_ms          wall time of `engine.step()`
  wait_ms          time blocked on the device for the in-flight step's tokens
  host_ms          step_ms - wait_ms: what the host spends per step
  schedule_ms      `Scheduler.schedule`
  dispatch_ms      `LLMEngine._dispatch`: building the inputs + enqueueing the executables
  rest_ms          host_ms - schedule_ms - dispatch_ms: commit, emit, detokenize, bookkeeping
  *_p50            the median over the steps of a run instead of the mean (spikes of a shared
                   machine hit the mean)
The summary holds each tree's median over the repeats and table/main ratios, plus the load
average before and after. With `--profile`, one child per tree runs the decode workload under
cProfile and the parent writes each tree's top functions (cumulative and own time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import write_json

WORKLOADS = ("decode", "mixed", "arrivals")
KEYS = (
    "step_ms",
    "wait_ms",
    "host_ms",
    "schedule_ms",
    "dispatch_ms",
    "rest_ms",
    "tokens_per_s",
    "host_ms_p50",
    "dispatch_ms_p50",
    "step_ms_p50",
)


# ---- child: one engine, timed ---------------------------------------------------------------------
class Timers:
    """perf_counter totals around schedule, dispatch and the token wait of one engine."""

    def __init__(self, engine):
        from runtime.steps import async_step

        self.totals = dict.fromkeys(("schedule", "dispatch", "wait"), 0.0)
        self._patched = [(engine.scheduler, "schedule", "schedule"), (engine, "_dispatch", "dispatch")]
        for owner, name, key in self._patched:
            setattr(owner, name, self._timed(getattr(owner, name), key))
        self._resolve = async_step.InFlightStep.resolve
        resolve = self._timed(self._resolve, "wait")
        async_step.InFlightStep.resolve = lambda step: None if step.resolved else resolve(step)

    def _timed(self, fn, key):
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.totals[key] += time.perf_counter() - t0

        return timed

    def close(self):
        from runtime.steps import async_step

        for owner, name, _ in self._patched:
            delattr(owner, name)
        async_step.InFlightStep.resolve = self._resolve


def serve(engine, requests, tag: str, concurrency: int | None = None) -> dict:
    """Serve `requests` to the end: all added at once, or (`concurrency`) at most that many in
    flight, the next added as soon as one finishes."""
    from runtime.types import EngineRequest, SamplingParams

    timers = Timers(engine)
    steps, step_time, tokens = 0, 0.0, 0
    per_step = []  # (step, wait, schedule, dispatch) seconds of each step
    pending = list(enumerate(requests))[::-1]

    def admit(n: int) -> None:
        for _ in range(min(n, len(pending))):
            i, r = pending.pop()
            engine.add_request(
                EngineRequest(
                    f"{tag}{i}",
                    list(r.prompt_ids),
                    SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                )
            )

    try:
        t_start = time.perf_counter()
        admit(concurrency or len(pending))
        while engine.has_unfinished():
            before = dict(timers.totals)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            step_time += dt
            per_step.append((dt, *(timers.totals[k] - before[k] for k in ("wait", "schedule", "dispatch"))))
            steps += 1
            finished = [o for o in outs if o.finished]
            tokens += sum(len(o.new_token_ids) for o in outs)
            if concurrency:
                admit(len(finished))
        elapsed = time.perf_counter() - t_start
    finally:
        timers.close()
    t = timers.totals
    per = lambda x: 1e3 * x / steps
    host = step_time - t["wait"]
    return {
        "steps": steps,
        "step_ms": per(step_time),
        "wait_ms": per(t["wait"]),
        "host_ms": per(host),
        "schedule_ms": per(t["schedule"]),
        "dispatch_ms": per(t["dispatch"]),
        "rest_ms": per(host - t["schedule"] - t["dispatch"]),
        "tokens_per_s": tokens / elapsed,
        # medians over the steps: robust to the spikes of a shared machine
        "host_ms_p50": 1e3 * statistics.median(d - w for d, w, _, _ in per_step),
        "dispatch_ms_p50": 1e3 * statistics.median(x for _, _, _, x in per_step),
        "step_ms_p50": 1e3 * statistics.median(d for d, _, _, _ in per_step),
    }


def workloads(vocab_size: int, seqs: int) -> dict:
    """name -> (requests, concurrency: None for all added at once)."""
    from benchmarks.workloads import make_uniform, make_workload

    mixed = dict(vocab_size=vocab_size, scale=0.25, max_model_len=1024)
    return {
        "decode": (make_uniform(seqs, 16, 96, vocab_size=vocab_size), None),
        "mixed": (make_workload("mixed", num_requests=seqs, **mixed), None),
        "arrivals": (make_workload("mixed", num_requests=8 * seqs, seed=1, **mixed), seqs),
    }


def child(args) -> None:
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    seqs = args.seqs[0]
    engine = LLMEngine(
        EngineConfig(
            model=args.checkpoint,
            dtype=args.dtype,
            max_model_len=1024,
            seed=0,
            max_num_seqs=seqs,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
            compile_cache_dir=args.compile_cache,
        )
    )
    result = {}
    for name, (requests, concurrency) in workloads(engine.model.cfg.vocab_size, seqs).items():
        serve(engine, requests, "warm", concurrency)  # every bucket the workload touches runs once before timing
        if args.profile and name == "decode":
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            result[name] = serve(engine, requests, "timed", concurrency)
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text).strip_dirs()
            stats.sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(30)
            result["profile"] = text.getvalue()
        else:
            result[name] = serve(engine, requests, "timed", concurrency)
    print("RESULT " + json.dumps(result), flush=True)


# ---- parent: alternate the trees -------------------------------------------------------------------
def run_child(
    tree: str, checkpoint: str, seqs: int, compile_cache: str, profile: bool = False, dtype: str = "float32"
) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        checkpoint,
        "--child",
        "--seqs",
        str(seqs),
        "--compile-cache",
        compile_cache,
        "--dtype",
        dtype,
    ] + (["--profile", "-"] if profile else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"child for {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--trees", nargs="+", default=["table=."], help="name=path pairs, alternated in this order")
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-cache", default=str(Path(".cache/host_step_xla").resolve()))
    ap.add_argument("--profile", type=str, default=None, help="write cProfile tops (decode, max seqs) here")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (bfloat16: the CPU plan's packed weights)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    trees = dict(t.split("=", 1) for t in args.trees)
    load_before = os.getloadavg()
    runs = {name: {str(s): [] for s in args.seqs} for name in trees}
    for rep in range(args.repeats):
        for seqs in args.seqs:
            for name, tree in trees.items():
                r = run_child(tree, args.checkpoint, seqs, args.compile_cache, dtype=args.dtype)
                runs[name][str(seqs)].append(r)
                line = ", ".join(
                    f"{w} {r[w]['tokens_per_s']:.0f} tok/s, host {r[w]['host_ms']:.2f} ms/step "
                    f"step {r[w]['step_ms']:.2f} ms"
                    for w in WORKLOADS
                )
                print(f"rep {rep} seqs {seqs} {name}: {line}", flush=True)
    median = lambda rs, w, k: statistics.median(r[w][k] for r in rs)
    summary = {
        name: {seqs: {w: {k: median(rs, w, k) for k in KEYS} for w in WORKLOADS} for seqs, rs in per_seqs.items()}
        for name, per_seqs in runs.items()
    }
    result = {
        "checkpoint": args.checkpoint,
        "trees": trees,
        "repeats": args.repeats,
        "dtype": args.dtype,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "median": summary,
        "runs": runs,
    }
    if len(trees) == 2:
        base, new = list(trees)
        result["ratio_new_over_base"] = {
            seqs: {
                w: {
                    k: summary[new][seqs][w][k] / summary[base][seqs][w][k]
                    for k in ("host_ms", "host_ms_p50", "dispatch_ms", "dispatch_ms_p50", "step_ms", "tokens_per_s")
                }
                for w in WORKLOADS
            }
            for seqs in summary[base]
        }
    if args.profile:
        with open(args.profile, "w") as f:
            for name, tree in trees.items():
                r = run_child(tree, args.checkpoint, max(args.seqs), args.compile_cache, profile=True, dtype=args.dtype)
                f.write(f"===== {name} ({tree}), {max(args.seqs)} sequences, decode workload =====\n")
                f.write(json.dumps(r["decode"]) + "\n" + r["profile"] + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    write_json(args.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
