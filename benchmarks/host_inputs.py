"""The host's share of building one step's inputs, without a device: the old host batch builder
(`runtime.steps.inputs.build_batch`, still attention DP's) vs the request table's `RequestTableHost.plan`,
and the sampler's `SamplingMetadata.from_params` with the per-row parameters (attention DP) vs
without them (the request table holds them), on the same synthetic steps, in one process.

    python -m benchmarks.host_inputs --seqs 16 64 --json out.json

Steps: `seqs` running requests, each decoding one token (the last one a placeholder) at
positions 100.. (prompt 100, page size 16, max_model_len 1024; temperature 0.8, top_p 0.95, no
penalties), or a mixed step with every fourth request feeding a 32-token chunk (a request past 1000 tokens starts over). Timed: the median over 5 rounds of the mean
over 300 steps. Complements benchmarks/host_step.py, whose engine steps on a shared 2-core
machine also carry the device work and its noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import write_json
from runtime.buckets import bucket_for
from runtime.scheduled import PLACEHOLDER_TOKEN, ScheduledSequence, SchedulerOutput
from runtime.steps.inputs import build_batch
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_host import RequestTableHost
from runtime.types import SamplingParams

PAGE, MAX_BLOCKS, BUCKETS = 16, 64, (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _Request:
    def __init__(self, i: int):
        self.request_id, self.allocation = f"r{i}", object()
        self.params = SamplingParams(temperature=0.8, top_p=0.95, seed=i)


def steps(seqs: int, n: int, mixed: bool) -> list[SchedulerOutput]:
    reqs = [_Request(i) for i in range(seqs)]
    pages = {r.request_id: list(range(1 + i * MAX_BLOCKS, 1 + (i + 1) * MAX_BLOCKS)) for i, r in enumerate(reqs)}
    outs, computed = [], {r.request_id: 0 for r in reqs}
    for k in range(n + 1):
        out = SchedulerOutput()
        for i, r in enumerate(reqs):
            start = computed[r.request_id]
            if k == 0:
                ids = list(range(3, 103))
            elif mixed and i % 4 == 0:
                ids = list(range(3, 35))
            else:
                ids = [PLACEHOLDER_TOKEN]
            if start + len(ids) > 1000:  # wraps around: recomputed from the start
                start, ids = 0, list(range(3, 35))
            table = pages[r.request_id][: -(-(start + len(ids)) // PAGE)]
            out.sequences.append(ScheduledSequence(r, ids, start, table, 0, start > 0, True))
            computed[r.request_id] = start + len(ids)
        outs.append(out)
    return outs


def time_per_step(fn, outs) -> float:
    t0 = time.perf_counter()
    for out in outs:
        fn(out)
    return 1e6 * (time.perf_counter() - t0) / len(outs)


def measure(seqs: int, mixed: bool, n: int = 300, rounds: int = 5) -> dict:
    outs = steps(seqs, n, mixed)
    bucket = lambda out: bucket_for(max(out.num_batched_tokens, len(out.sequences)), BUCKETS)
    build, plan, meta, meta_table = [], [], [], []

    def sampling(out, row_params):
        reqs = [seq.request for seq in out.sequences]
        n = len(reqs)
        return SamplingMetadata.from_params(
            [r.params for r in reqs],
            [1] * n,
            [[]] * n,
            [[]] * n,
            pad_to=seqs,
            banned_ids=[[]] * n,
            row_params=row_params,
        )

    for _ in range(rounds):
        host = RequestTableHost(seqs, PAGE, BUCKETS[-1])
        host.plan(outs[0], bucket(outs[0]))  # placements (prefill of 100 tokens)
        plan.append(time_per_step(lambda out: host.plan(out, bucket(out)), outs[1:]))
        build.append(
            time_per_step(
                lambda out: build_batch(
                    out, token_buckets=BUCKETS, max_num_seqs=seqs, max_blocks_per_seq=MAX_BLOCKS, page_size=PAGE
                ),
                outs[1:],
            )
        )
        meta.append(time_per_step(lambda out: sampling(out, True), outs[1:]))
        meta_table.append(time_per_step(lambda out: sampling(out, False), outs[1:]))
    b, p = statistics.median(build), statistics.median(plan)
    m, mt = statistics.median(meta), statistics.median(meta_table)
    return {
        "build_batch_us": b,
        "table_plan_us": p,
        "ratio_plan_over_build": p / b,
        "sampling_metadata_us": m,
        "sampling_metadata_table_us": mt,
        "ratio_meta_table_over_host": mt / m,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = {str(s): {w: measure(s, w == "mixed") for w in ("decode", "mixed")} for s in args.seqs}
    print(json.dumps(result, indent=1))
    write_json(args.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
