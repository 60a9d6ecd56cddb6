"""Asynchronous scheduling on vs off, in one process: tokens/s, inter-token latency, host time per
step and how long the device waits for the host.

    python -m benchmarks.async_scheduling .cache/peers/tiny-llama --workload mixed --scale 0.25
    python -m benchmarks.async_scheduling .cache/jaxserve/SmolLM2-135M-Instruct.Q4_1.gguf \
        --workload fixed --scale 1.0 --num-requests 16 --max-num-seqs 16 --json out.json

One engine (compiled once) serves the workload at saturation — every request added at once,
greedy, `ignore_eos` — once per mode untimed (a bucket's first execution is slow), then
`--repeats` times in each mode, the modes interleaved (on, off, on, off, ...) so a contended
machine hurts both alike; the summary holds the median of the repeats.

Per run:
  output_tokens_per_s   output tokens / wall time of the run
  itl_p50/p99_ms        gaps between consecutive tokens of a request as `step()` returns them
  ttft_p50/p99_ms       from the start of the run (every request added then) to a request's
                        first token. Synchronous steps return step n's tokens only after step
                        n+1 ran (the host emits step n while the device runs n+1, then waits),
                        so a long step shows up in their TTFT; asynchronous steps return them
                        as soon as they are ready, so the same step shows up in the ITL.
  host_ms_per_step      host time in schedule + input build + dispatch (timers around each)
  wait_ms_per_step      time the host blocks on a step's tokens (device busy, host idle)
  device_idle_share     per step, the time from a step's tokens being ready (the end of a wait
                        that blocked) to the dispatch of the next step, over the step's
                        interval — the share of a step the device waits for the host. A wait
                        that did not block means the device had finished earlier at an unknown
                        time: those steps count 0 (so this is a lower bound) and are counted in
                        `unblocked_waits`.
  step_ms_p50/p99       intervals between consecutive steps' tokens becoming ready, and the
                        three slowest with their token counts (what the ITL tail is made of)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import write_json
from benchmarks.workloads import make_workload


class StepTimers:
    """Wraps an engine's schedule / dispatch / token wait with perf_counter timers."""

    def __init__(self, engine):
        from runtime.steps import async_step

        self.engine, self.records = engine, []
        self._schedule, self._dispatch = engine.scheduler.schedule, engine._dispatch
        self._resolve = async_step.InFlightStep.resolve
        self.current: dict = {}
        timers = self

        def schedule():
            t0 = time.perf_counter()
            out = timers._schedule()
            timers.current = {"host": time.perf_counter() - t0}
            return out

        def dispatch(out):
            t0 = time.perf_counter()
            pending = timers._dispatch(out)
            t1 = time.perf_counter()
            timers.current["host"] += t1 - t0
            timers.current.update(dispatched_at=t1, out=out)
            timers.records.append(timers.current)
            return pending

        def resolve(step):
            if step.resolved:
                return
            t0 = time.perf_counter()
            timers._resolve(step)
            t1 = time.perf_counter()
            rec = next(r for r in reversed(timers.records) if r["out"] is step.out)
            rec.update(wait=t1 - t0, ready_at=t1)

        engine.scheduler.schedule, engine._dispatch = schedule, dispatch
        async_step.InFlightStep.resolve = resolve

    def close(self):
        from runtime.steps import async_step

        del self.engine.scheduler.schedule, self.engine._dispatch
        async_step.InFlightStep.resolve = self._resolve


def _percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_once(engine, requests, async_scheduling: bool) -> dict:
    from runtime.types import EngineRequest, SamplingParams

    engine.async_scheduling = async_scheduling
    timers = StepTimers(engine)
    last_emit: dict[str, tuple[float, int]] = {}
    gaps, ttfts = [], []
    try:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            engine.add_request(
                EngineRequest(
                    f"b{i}",
                    list(r.prompt_ids),
                    SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                )
            )
        total = 0
        while engine.has_unfinished():
            for out in engine.step():
                prev = last_emit.get(out.request_id)
                now, n = time.perf_counter(), (prev[1] if prev else 0) + len(out.new_token_ids)
                if prev is None and n:
                    ttfts.append((now - t0) * 1e3)
                if prev is not None and n > prev[1]:
                    gaps.append((now - prev[0]) * 1e3)
                last_emit[out.request_id] = (now, n)
                if out.finished:
                    total += n
        elapsed = time.perf_counter() - t0
    finally:
        timers.close()
    recs = [r for r in timers.records if "wait" in r]
    idle, unblocked = [], 0
    for rec, nxt in itertools.pairwise(recs):
        interval = nxt["dispatched_at"] - rec["dispatched_at"]
        if rec["wait"] < 1e-4:
            unblocked += 1
            idle.append(0.0)
        else:
            idle.append(max(0.0, nxt["dispatched_at"] - rec["ready_at"]) / max(interval, 1e-9))
    assert total == sum(r.max_tokens for r in requests), "engine did not honour max_tokens"
    # ready-to-ready intervals: how long each step took to come out, with its token count
    spans = sorted(
        ((b["ready_at"] - a["ready_at"]) * 1e3, b["out"].num_batched_tokens) for a, b in itertools.pairwise(recs)
    )
    return {
        "async_scheduling": async_scheduling,
        "seconds": elapsed,
        "output_tokens": total,
        "output_tokens_per_s": total / elapsed,
        "steps": len(timers.records),
        "itl_p50_ms": _percentile(gaps, 50),
        "itl_p99_ms": _percentile(gaps, 99),
        "ttft_p50_ms": _percentile(ttfts, 50),
        "ttft_p99_ms": _percentile(ttfts, 99),
        "host_ms_per_step": 1e3 * statistics.fmean(r["host"] for r in timers.records),
        "wait_ms_per_step": 1e3 * statistics.fmean(r["wait"] for r in recs) if recs else 0.0,
        "device_idle_share": statistics.fmean(idle) if idle else 0.0,
        "unblocked_waits": unblocked,
        "step_ms_p50": _percentile([ms for ms, _ in spans], 50),
        "step_ms_p99": _percentile([ms for ms, _ in spans], 99),
        "slowest_steps_ms_tokens": [(round(ms, 1), n) for ms, n in spans[-3:]],
    }


def summarize(runs: list[dict]) -> dict:
    keys = (
        "output_tokens_per_s",
        "itl_p50_ms",
        "itl_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "host_ms_per_step",
        "wait_ms_per_step",
        "device_idle_share",
        "steps",
        "unblocked_waits",
        "step_ms_p50",
        "step_ms_p99",
    )
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=args.checkpoint,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=0,
            keep_gguf_quantized=False,
            enable_prefix_caching=False,
        )
    )
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    requests = make_workload(
        args.workload,
        vocab_size=engine.model.cfg.vocab_size,
        scale=args.scale,
        num_requests=args.num_requests,
        max_model_len=args.max_model_len,
    )
    for mode in (True, False):  # warm-up: every bucket the workload touches runs once before timing
        run_once(engine, requests, mode)
    runs = {True: [], False: []}
    for rep in range(args.repeats):
        for mode in (True, False):
            r = run_once(engine, requests, mode)
            runs[mode].append(r)
            print(
                f"rep {rep} async={mode}: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.2f} "
                f"p99 {r['itl_p99_ms']:.2f} ms, host {r['host_ms_per_step']:.2f} ms/step, wait "
                f"{r['wait_ms_per_step']:.2f} ms/step, device idle {100 * r['device_idle_share']:.1f}% "
                f"({r['unblocked_waits']} unblocked waits / {r['steps']} steps)",
                flush=True,
            )
    on, off = summarize(runs[True]), summarize(runs[False])
    result = {
        "checkpoint": args.checkpoint,
        "workload": args.workload,
        "scale": args.scale,
        "num_requests": len(requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "max_num_seqs": args.max_num_seqs,
        "repeats": args.repeats,
        "async_on": on,
        "async_off": off,
        "ratio_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    write_json(args.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
