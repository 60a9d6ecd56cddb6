"""P/D on this machine: transfer bandwidth, added TTFT, bytes per request, colocated vs 1P+1D.

    python -m benchmarks.disagg [--families llama qwen3_5] [--kv-cache-dtype fp8_e4m3] [--mixed-family qwen3_5]
                                [--before REF [--rounds 2]] [--json out.json]

For each tiny checkpoint (built locally, as the tests do) it launches prefill, decode and proxy
processes on 127.0.0.1 (benchmarks/pd_cluster.py) and measures:
  bytes/request   from the descriptor of a prefill leg: attention KV vs GDN state bytes (true
                  bytes for the prompt's tokens, and what the padded wire format moved);
  added TTFT      median over sequential streamed requests of TTFT through the proxy minus TTFT
                  of the same request sent to the prefill instance alone (colocated path);
  bandwidth       the decode side's bytes pulled / seconds in pulls (claim + pull, CPU loopback).
Then one mixed run (long prompts arriving among streaming decodes, benchmarks/serve.py's client
and metrics) against one colocated instance pinned to both cores (`taskset -c 0,1`) and against
1P+1D with the prefill instance on core 0 and decode (+ proxy) on core 1: p50/p99 TTFT and ITL.
Ratios, not absolute speed, are the point; the machine is shared, so run it on a quiet one.

`--before REF` measures the added TTFT of git revision REF too (a detached worktree under
/tmp), alternating REF and this tree `--rounds` times per family in the same invocation: the
overhead of a change (e.g. issue 29's token, claim checks and deadlines) as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.pd_cluster import BASE_FLAGS, TOKEN, PDCluster, Process, scrape
from benchmarks.peers import worktree
from benchmarks.serve import compute_metrics, run_load, send_completion
from benchmarks.workloads import BenchRequest

ROOT = Path(__file__).resolve().parents[1]


def checkpoint(family: str) -> Path:
    from benchmarks.tiny_checkpoints import build_cached_checkpoint

    return build_cached_checkpoint(family)


def _post(url: str, body: dict) -> dict:
    headers = {"Content-Type": "application/json", "X-KV-Transfer-Token": TOKEN}  # as the proxy sends it
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def bytes_per_request(prefill_url: str, prompt: list[int]) -> dict:
    params = _post(
        prefill_url + "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )["kv_transfer_params"]
    desc = params["descriptor"]
    wire = {"kv": 0, "state": 0}
    for name, shape, dtype in desc["arrays"]:
        wire["kv" if name.startswith("kv") else "state"] += int(np.prod(shape)) * np.dtype(dtype).itemsize
    kv_true = wire["kv"] * desc["num_tokens"] / (desc["num_pages"] * desc["page_size"]) if wire["kv"] else 0
    return {
        "prompt_tokens": len(prompt),
        "kv_bytes": int(kv_true),
        "state_bytes": wire["state"],
        "state_share": wire["state"] / max(1, kv_true + wire["state"]),
        "wire_bytes": wire["kv"] + wire["state"],
    }


async def _ttfts(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            result = await send_completion(session, url, model, BenchRequest(tuple(prompt), 4))
            assert result.success, result.error
            out.append(result.ttft)
    return out


def measure_family(family: str, prompt_len: int, reps: int, kv_cache_dtype: str = "auto", root: Path = ROOT) -> dict:
    """`kv_cache_dtype` on both sides (FP8: pages and scales copied verbatim); `root`: the
    source tree the processes run."""
    rng = np.random.default_rng(0)
    kv = ["--set", f"cache.kv_cache_dtype={kv_cache_dtype}"]
    with PDCluster(checkpoint(family), prefill=kv, decode=kv, root=root) as pd:
        model = json.loads(urllib.request.urlopen(pd.proxy_url + "/v1/models").read())["data"][0]["id"]
        prompts = [[int(t) for t in rng.integers(3, 500, prompt_len)] for _ in range(reps)]
        asyncio.run(_ttfts(pd.proxy_url, model, prompts[:2]))  # compile both sides' buckets
        asyncio.run(_ttfts(pd.prefill.url, model, prompts[:2]))
        before = scrape(pd.decode.url)
        # fresh prompts for both paths (no prefix hit on either), interleaved
        direct = asyncio.run(_ttfts(pd.prefill.url, model, [p[::-1] for p in prompts]))
        via_proxy = asyncio.run(_ttfts(pd.proxy_url, model, prompts))
        after = scrape(pd.decode.url)
        pulled = after["jaxserve_kv_transfer_bytes_pulled"] - before["jaxserve_kv_transfer_bytes_pulled"]
        seconds = after["jaxserve_kv_transfer_seconds_transferred"] - before["jaxserve_kv_transfer_seconds_transferred"]
        sizes = [bytes_per_request(pd.prefill.url, [int(t) for t in rng.integers(3, 500, n)]) for n in (64, prompt_len)]
    return {
        "family": family,
        "kv_cache_dtype": kv_cache_dtype,
        "prompt_len": prompt_len,
        "reps": reps,
        "ttft_colocated_ms": 1e3 * statistics.median(direct),
        "ttft_pd_ms": 1e3 * statistics.median(via_proxy),
        "added_ttft_ms": 1e3 * (statistics.median(via_proxy) - statistics.median(direct)),
        "pull_bandwidth_MBps": pulled / max(seconds, 1e-9) / 1e6,
        "bytes_pulled": pulled,
        "pull_seconds_mean": seconds / reps,
        "bytes_per_request": sizes,
    }


def compare_trees(
    ref: str, families: list[str], prompt_len: int, reps: int, kv_cache_dtype: str, rounds: int
) -> list[dict]:
    """TTFT through P/D of revision `ref` and of this tree, alternated `rounds` times per family."""
    trees = {"before": worktree(ref), "after": ROOT}
    rows = []
    for family in families:
        runs = {"before": [], "after": []}
        for _ in range(rounds):
            for label, root in trees.items():
                row = measure_family(family, prompt_len, reps, kv_cache_dtype, root=root)
                runs[label].append(row)
                print(
                    json.dumps({"tree": label, **{k: v for k, v in row.items() if k != "bytes_per_request"}}),
                    flush=True,
                )
        med = {
            label: {
                key: statistics.median(r[key] for r in rs)
                for key in ("ttft_colocated_ms", "ttft_pd_ms", "added_ttft_ms")
            }
            for label, rs in runs.items()
        }
        rows.append(
            {
                "family": family,
                "ref": ref,
                "rounds": rounds,
                "reps": reps,
                **{f"{label}_{key}": value for label, m in med.items() for key, value in m.items()},
                "ttft_pd_after_over_before": med["after"]["ttft_pd_ms"] / med["before"]["ttft_pd_ms"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def mixed_workload(n_long: int, n_short: int, long_len: int, short_len: int, short_out: int) -> list[BenchRequest]:
    rng = np.random.default_rng(1)
    reqs = [BenchRequest(tuple(int(t) for t in rng.integers(3, 500, short_len)), short_out) for _ in range(n_short)]
    longs = [BenchRequest(tuple(int(t) for t in rng.integers(3, 500, long_len)), 4) for _ in range(n_long)]
    for i, req in enumerate(longs):  # long prompts arrive among the streaming decodes
        reqs.insert(1 + i * (len(reqs) // max(1, n_long)), req)
    return reqs


def _run_mixed(url: str, requests: list[BenchRequest], rate: float) -> dict:
    model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
    results, duration = asyncio.run(run_load(url, model, requests, request_rate=rate))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    m = compute_metrics(results, duration)
    keep = ("completed", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")
    return {k: m[k] for k in keep if k in m}


AOT = ["--set", "compile.aot=true"]  # every bucket compiled before "ready": no compile inside the run


def compare_colocated(family: str, rate: float, requests: list[BenchRequest]) -> dict:
    path = checkpoint(family)
    warm = requests[:3]
    colocated = Process(
        "colocated", ["serve", str(path), *BASE_FLAGS, *AOT], launcher=["taskset", "-c", "0,1"], timeout_s=900
    )
    try:
        _run_mixed(colocated.url, warm, float("inf"))
        both = _run_mixed(colocated.url, requests, rate)
    finally:
        colocated.kill()
    pd = PDCluster.__new__(PDCluster)
    pd.processes = []
    try:
        pd.prefill = Process(
            "prefill",
            ["serve", str(path), "--role", "prefill", *BASE_FLAGS, *AOT],
            launcher=["taskset", "-c", "0"],
            timeout_s=900,
        )
        pd.processes.append(pd.prefill)
        pd.decode = Process(
            "decode",
            ["serve", str(path), "--role", "decode", *BASE_FLAGS, *AOT],
            launcher=["taskset", "-c", "1"],
            timeout_s=900,
        )
        pd.processes.append(pd.decode)
        pd.proxy = Process(
            "proxy",
            ["proxy", "--prefill", pd.prefill.url, "--decode", pd.decode.url, "--port", "0"],
            launcher=["taskset", "-c", "1"],
        )
        pd.processes.append(pd.proxy)
        _run_mixed(pd.proxy.url, warm, float("inf"))
        split = _run_mixed(pd.proxy.url, requests, rate)
    finally:
        pd.close()
    return {"family": family, "rate": rate, "colocated_2cores": both, "pd_1p1d_1core_each": split}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["llama", "qwen3_5"])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", default="auto", help="both sides, e.g. fp8_e4m3 (default: model dtype)")
    parser.add_argument("--mixed-family", default="qwen3_5", help="'' skips the colocated vs 1P+1D run")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--before", default=None, metavar="REF", help="also measure git revision REF, alternated")
    parser.add_argument("--rounds", type=int, default=2, help="with --before: REF / this tree alternations")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = {"families": [], "mixed": None}
    if args.before:
        report["before_after"] = compare_trees(
            args.before, args.families, args.prompt_len, args.reps, args.kv_cache_dtype, args.rounds
        )
        args.families, args.mixed_family = [], ""
    for family in args.families:
        t0 = time.perf_counter()
        row = measure_family(family, args.prompt_len, args.reps, args.kv_cache_dtype)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f}s)", flush=True)
        report["families"].append(row)
    if args.mixed_family:
        requests = mixed_workload(n_long=6, n_short=12, long_len=400, short_len=24, short_out=48)
        report["mixed"] = compare_colocated(args.mixed_family, args.rate, requests)
        print(json.dumps(report["mixed"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
