"""Device-free simulation of hybrid prefix caching at real model shapes: hit rate vs memory.

    python benchmarks/prefix_cache_sim.py --model configs/models/qwen3_5-9b.json --trace chat \
        --policy auto --policy page --policy align:528 --budget 0.1 [--json out.json]
    python benchmarks/prefix_cache_sim.py --render out.json     # the markdown table of docs/prefix_caching.md

Drives the real `paged_kv.CacheManager` and `runtime.scheduling.scheduler.Scheduler` (no JAX, no weights)
with a trace of sessions (`benchmarks/prefix_traces.py`): every step is schedule -> a fake
model that "generates" the trace's fixed outputs -> update. Memory is the engine's sizing rule
at the model's real bytes (`benchmarks/model_shapes.py`): a device of `--device-gib` usable GiB
(x `--devices` for tensor parallelism) x `--memory-fraction`, minus bf16 weights, split into
KV pages, one running state slot per sequence and checkpoint slots (2 per sequence, at most
`--budget` of the cache memory).

Reported per policy: token hit rate (hit tokens / queried prompt tokens over all admissions),
the ceiling (the same trace with KV pages only, unbounded: every cached page boundary usable,
as if state were free) and the hit rate as a fraction of it, prefill tokens computed and
saved, memory by use (time-averaged and peak GiB of KV pages held by running requests, cached
KV, running state slots, checkpoints), evictions, checkpoints written, preemptions, steps.
Deterministic for a trace seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_shapes import GIB, MemoryPlan, load_shape, plan_memory
from benchmarks.prefix_traces import TRACES, Session, make_trace
from paged_kv import CacheManager
from paged_kv.host_tier import KV, STATE
from paged_kv.tiered_cache import TieredCacheManager
from runtime.engine_config import SchedulerConfig
from runtime.scheduling.request import Request
from runtime.scheduling.scheduler import Scheduler
from runtime.types import SamplingParams


@dataclass
class SimConfig:
    page_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144
    max_steps: int = 1_000_000


@dataclass
class _Usage:
    """Time-integrals and peaks of pages/slots by use."""

    steps: int = 0
    sums: dict = field(default_factory=dict)
    peaks: dict = field(default_factory=dict)

    def add(self, stats: dict, num_checkpoints: int) -> None:
        sample = {
            "kv_running": stats["pages_used"],
            "kv_cached": stats["pages_cached"],
            "slots_running": stats["slots_used"],
            "checkpoints": num_checkpoints,
        }
        self.steps += 1
        for key, value in sample.items():
            self.sums[key] = self.sums.get(key, 0) + value
            self.peaks[key] = max(self.peaks.get(key, 0), value)


def _prefix_pages(sessions: list[Session]) -> int:
    return sum(len(s.prompt(len(s.turns) - 1)) + len(s.turns[-1].output) for s in sessions)


def drain_host_transfers(cache, page_bytes: int, state_bytes: int) -> None:
    """The engine's part of a host tier (runtime/engine/host_tier.py), without arrays: every offload
    is stored at its real size (a page's or a state slot's bytes), loads need nothing."""
    offloads, _, restores = cache.take_transfers()
    size = {KV: page_bytes, STATE: state_bytes}
    for kind, _, block_hash in offloads:
        cache.store(kind, block_hash, kind, size[kind])  # no arrays: any value but None
    for (kind, block_hash), value in restores:
        cache.store(kind, block_hash, value, size[kind])


def run_trace(sessions: list[Session], cache: CacheManager, config: SimConfig, sizes=(1, 1)) -> dict:
    """Serve every session's turns through the real scheduler; returns counts and usage. A
    `TieredCacheManager` (host tier) has its transfers drained each step at `sizes` (page, slot bytes)."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
        ),
        cache,
    )
    next_turn = {s.session_id: 0 for s in sessions}
    arrivals = sorted((s.start_step, i) for i, s in enumerate(sessions))
    outputs: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Session] = {}
    usage = _Usage()
    prefill_tokens = step = 0
    while arrivals or scheduler.has_unfinished():
        if not scheduler.has_unfinished() and arrivals[0][0] > step:
            step = arrivals[0][0]  # idle: jump to the next arrival
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            session = sessions[i]
            k = next_turn[session.session_id]
            request_id = f"{session.session_id}/{k}"
            output = session.turns[k].output
            outputs[request_id], owner[request_id] = output, session
            scheduler.add_request(
                Request(request_id, session.prompt(k), SamplingParams(max_tokens=len(output), ignore_eos=True))
            )
        out = scheduler.schedule()
        if isinstance(cache, TieredCacheManager):
            drain_host_transfers(cache, *sizes)
        sampled = {}
        for seq in out.sequences:
            if seq.request.num_tokens - seq.start_position > 1:
                prefill_tokens += seq.num_new_tokens
            if seq.sample:
                sampled[seq.request_id] = [outputs[seq.request_id][seq.request.num_output_tokens]]
        for request in scheduler.update_from_output(out, sampled):
            session = owner.pop(request.request_id)
            next_turn[session.session_id] += 1
            if next_turn[session.session_id] < len(session.turns):
                position = step + 1 + session.think_steps
                arrivals.append((position, sessions.index(session)))
                arrivals.sort()
        stats = cache.stats()
        usage.add(stats, stats["slots_cached"] + cache.num_pending_checkpoints)
        step += 1
        if step > config.max_steps:
            raise RuntimeError(f"simulation did not finish in {config.max_steps} steps")
    stats = scheduler.stats()
    return {"stats": stats, "usage": usage, "prefill_tokens": prefill_tokens, "steps": usage.steps}


def simulate(sessions: list[Session], plan: MemoryPlan, policy: str, config: SimConfig, host_gib: float = 0) -> dict:
    """One policy at one memory plan (and `host_gib` of host tier): the summary row (GiB, rates)."""
    kwargs = dict(
        page_size=config.page_size,
        num_pages=plan.num_pages,
        num_state_slots=plan.num_state_slots,
        checkpoint_policy=policy,
        num_checkpoint_slots=plan.num_checkpoint_slots,
    )
    cache = TieredCacheManager(host_bytes=int(host_gib * GIB), **kwargs) if host_gib else CacheManager(**kwargs)
    run = run_trace(sessions, cache, config, (plan.page_bytes, plan.state_bytes))
    stats, usage = run["stats"], run["usage"]
    page_gib, slot_gib = plan.page_bytes / GIB, plan.state_bytes / GIB
    gib = {"kv_running": page_gib, "kv_cached": page_gib, "slots_running": slot_gib, "checkpoints": slot_gib}
    return {
        "policy": policy,
        "hit_rate": stats["prefix_cache_hit_rate"],
        "hit_tokens": stats["prefix_cache_hit_tokens"],
        "queried_tokens": stats["prefix_cache_queried_tokens"],
        "prefill_tokens": run["prefill_tokens"],
        "avg_gib": {k: round(usage.sums[k] / usage.steps * gib[k], 2) for k in gib},
        "peak_gib": {k: round(usage.peaks[k] * gib[k], 2) for k in gib},
        "checkpoint_share_of_cache": round(plan.checkpoint_bytes / plan.cache_bytes, 3),
        "page_evictions": stats["page_evictions"],
        "checkpoints_written": stats["checkpoints_written"],
        "checkpoint_evictions": stats["checkpoint_evictions"],
        "preemptions": stats["num_preemptions"],
        "steps": run["steps"],
        "host_gib": host_gib,
        **{k: v for k, v in stats.items() if k.startswith("host_cache_")},
    }


def ceiling(sessions: list[Session], config: SimConfig) -> dict:
    """KV pages only and unbounded: the hit rate if every cached page boundary were usable."""
    pages = _prefix_pages(sessions) // config.page_size + len(sessions) + 2
    cache = CacheManager(page_size=config.page_size, num_pages=pages)
    run = run_trace(sessions, cache, config)
    return {
        "hit_rate": run["stats"]["prefix_cache_hit_rate"],
        "hit_tokens": run["stats"]["prefix_cache_hit_tokens"],
        "prefill_tokens": run["prefill_tokens"],
    }


def markdown_table(rows: list[dict]) -> str:
    """The docs' table: one line per (model, trace, budget, policy) row of `simulate`."""
    lines = [
        "| model | trace | checkpoint budget | policy | hit rate | ceiling | of ceiling | ckpt GiB avg / peak "
        "| KV running / cached GiB avg | state running GiB avg | ckpt evictions | page evictions | prefill tokens | steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        avg, peak = r["avg_gib"], r["peak_gib"]
        of = "-" if r["of_ceiling"] is None else f"{r['of_ceiling']:.0%}"
        budget = "2 x seqs shared" if r["budget"] < 0 else f"{r['budget']:.0%}: {r['num_checkpoint_slots']} slots"
        lines.append(
            f"| {r['model']} | {r['trace']} | {budget} | `{r['policy']}` | {r['hit_rate']:.1%} "
            f"| {r['ceiling']:.1%} | {of} | {avg['checkpoints']:.1f} / {peak['checkpoints']:.1f} "
            f"| {avg['kv_running']:.1f} / {avg['kv_cached']:.1f} | {avg['slots_running']:.1f} "
            f"| {r['checkpoint_evictions']} | {r['page_evictions']} | {r['prefill_tokens']:,} | {r['steps']:,} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--render", nargs="+", default=None, help="print the markdown table of these JSON results")
    parser.add_argument("--model", action="append", help="HF config.json (repeatable)")
    parser.add_argument("--trace", action="append", choices=TRACES)
    parser.add_argument("--policy", action="append", default=None, help="CheckpointPolicy spec (repeatable)")
    parser.add_argument(
        "--budget",
        type=float,
        action="append",
        default=None,
        help="largest fraction of cache memory for checkpoint slots (2 per sequence; repeatable; default "
        "0.25 as the engine; -1: the original 2 x max_num_seqs shared slots)",
    )
    parser.add_argument(
        "--host-gib", type=float, action="append", default=None, help="host tier GiB (repeatable; 0: off)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--device-gib", type=float, default=139.0)
    parser.add_argument("--memory-fraction", type=float, default=0.9)
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-sessions", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.render:
        print(markdown_table([row for path in args.render for row in json.loads(Path(path).read_text())]))
        return
    if not args.model or not args.trace:
        parser.error("--model and --trace are required (or --render)")
    config = SimConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    rows = []
    for model in args.model:
        shape = load_shape(model)
        for trace_name in args.trace:
            sessions = make_trace(
                trace_name, vocab_size=shape.vocab_size, seed=args.seed, num_sessions=args.num_sessions
            )
            top = ceiling(sessions, config)
            for budget in args.budget or [0.25]:
                plan = plan_memory(
                    shape,
                    device_gib=args.device_gib * args.devices,
                    page_size=config.page_size,
                    memory_fraction=args.memory_fraction,
                    kv_dtype=args.kv_dtype,
                    max_num_seqs=config.max_num_seqs,
                    budget_fraction=None if budget < 0 else budget,
                )
                for policy, host_gib in [(p, h) for p in args.policy or ["auto"] for h in args.host_gib or [0]]:
                    row = simulate(sessions, plan, policy, config, host_gib)
                    row.update(
                        model=shape.name,
                        trace=trace_name,
                        budget=budget,
                        ceiling=top["hit_rate"],
                        of_ceiling=round(row["hit_rate"] / top["hit_rate"], 3) if top["hit_rate"] else None,
                        cache_gib=round(plan.cache_bytes / GIB, 1),
                        num_pages=plan.num_pages,
                        num_checkpoint_slots=plan.num_checkpoint_slots,
                    )
                    rows.append(row)
                    print(
                        f"{shape.name:20s} {trace_name:13s} budget {budget:5} host {host_gib:5} GiB {policy:12s} hit {row['hit_rate']:.3f} "
                        f"ceiling {top['hit_rate']:.3f} ({row['of_ceiling']}) ckpt {row['checkpoint_share_of_cache']:.0%} "
                        f"of cache, avg GiB {row['avg_gib']} evict pages {row['page_evictions']} "
                        f"ckpts {row['checkpoint_evictions']} written {row['checkpoints_written']} "
                        f"preempt {row['preemptions']} prefill {row['prefill_tokens']} steps {row['steps']}",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
