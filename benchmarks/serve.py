"""Online serving benchmark: an asyncio + aiohttp load generator for any OpenAI-compatible server.

    python -m benchmarks.serve --url http://127.0.0.1:8000 --label ours --workload fixed \
        --scale 0.25 --rates 1,4,inf --slo ttft:2000 --slo tpot:200 --json out.json --plot out.png

Streams POST /v1/completions with token-id prompts (`ignore_eos`, so output lengths are exact)
at Poisson (gamma, `--burstiness`) arrival rates or under a fixed concurrency, and reports
request/token throughput, TTFT, TPOT, ITL and e2e latency (mean, median, p50/p90/p99) and
goodput under an SLO. Definitions match `vllm bench serve` (vllm/benchmarks/serve.py and
lib/endpoint_request_func.py):
  TTFT   time from sending the request to the first SSE chunk that carries `choices`;
  ITL    gap between consecutive `choices` chunks (one entry per chunk, not per token);
  e2e    time from sending the request to the LAST `choices` chunk (the usage chunk and
         [DONE] do not count);
  TPOT   (e2e - TTFT) / (output_tokens - 1), only for requests with > 1 output token
         (it excludes the first token); goodput counts such a request's TPOT as 0;
  output_tokens  the server's `usage.completion_tokens` (stream_options.include_usage), and
         prompt tokens its `usage.prompt_tokens` when given;
  arrivals  cumulative gamma gaps rescaled to end at n/rate (vLLM's `get_request`);
  throughputs    totals over the benchmark's wall duration (first send to last completion);
  goodput        requests/s meeting every given SLO (ttft/tpot/e2el, in ms).
Percentiles are numpy's linear-interpolation percentiles, as in vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.workloads import WORKLOADS, BenchRequest, make_workload, summarize

PERCENTILES = (50, 90, 99)
_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # s
    latency: float = 0.0  # s, e2e
    itl: list[float] = dataclasses.field(default_factory=list)  # s, one per chunk after the first
    start_time: float = 0.0  # perf_counter at send
    error: str = ""


async def send_completion(
    session: aiohttp.ClientSession, url: str, model: str, request: BenchRequest, *, api_key: str | None = None
) -> RequestResult:
    """One streamed /v1/completions request, timed the way vLLM's client times it."""
    payload = {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(prompt_len=request.prompt_len)
    st = time.perf_counter()
    result.start_time = st
    most_recent = st
    first_chunk = False
    try:
        async with session.post(url.rstrip("/") + "/v1/completions", json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:  # one SSE line per iteration
                line = raw.strip()
                if not line or line.startswith(b":"):
                    continue
                chunk = line.decode("utf-8").removeprefix("data:").strip()
                if chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                if data.get("choices"):
                    now = time.perf_counter()
                    if not first_chunk:
                        first_chunk = True
                        result.ttft = now - st
                    else:
                        result.itl.append(now - most_recent)
                    most_recent = now
                if data.get("usage"):
                    result.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                    if data["usage"].get("prompt_tokens") is not None:
                        result.prompt_len = int(data["usage"]["prompt_tokens"])
        if first_chunk:
            result.success = True
            result.latency = most_recent - st
        else:
            result.error = "never received a chunk with choices"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times (s from the start), as vLLM schedules them: cumulative gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps, rescaled so the last request goes out at exactly n/rate."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n))
    return times * (n / request_rate) / times[-1] if n and times[-1] > 0 else times


async def run_load(
    url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule; -> (results in request order, duration s)."""
    send_at = arrival_times(len(requests), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector) as session:

        async def one(req: BenchRequest) -> RequestResult:
            if gate is None:
                return await send_completion(session, url, model, req, api_key=api_key)
            async with gate:
                return await send_completion(session, url, model, req, api_key=api_key)

        start = time.perf_counter()
        tasks = []
        for req, at in zip(requests, send_at):
            wait = start + float(at) - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def _stats(values_s: list[float], prefix: str) -> dict:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{prefix}_ms": float(np.mean(ms)),
        f"median_{prefix}_ms": float(np.median(ms)),
        f"std_{prefix}_ms": float(np.std(ms)),
    }
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    """vLLM's `calculate_metrics` over our results (see the module docstring for definitions)."""
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    completed = good = total_input = total_output = 0
    for r in results:
        if not r.success:
            continue
        completed += 1
        total_input += r.prompt_len
        total_output += r.output_tokens
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
    if slo_ms:
        unknown = set(slo_ms) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"unknown SLO metrics {sorted(unknown)}; use ttft, tpot, e2el")
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            if all(per_request[k][i] <= v / 1000.0 for k, v in slo_ms.items()):
                good += 1
    metrics = {
        "duration_s": duration_s,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if slo_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for values, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (e2els, "e2el")):
        metrics.update(_stats(values, name))
    return metrics


def format_metrics(label: str, rate_label: str, m: dict) -> str:
    lines = [
        f"==== {label} @ {rate_label} ====",
        f"requests ok/failed       {m['completed']}/{m['failed']}   duration {m['duration_s']:.2f} s",
        f"request throughput       {m['request_throughput']:.3f} req/s"
        + (f"   goodput {m['request_goodput']:.3f} req/s" if m["request_goodput"] is not None else ""),
        f"output token throughput  {m['output_throughput']:.2f} tok/s   total {m['total_token_throughput']:.2f} tok/s",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(
            f"{name.upper():5s} ms  mean {m[f'mean_{name}_ms']:9.2f}  p50 {m[f'p50_{name}_ms']:9.2f}  "
            f"p90 {m[f'p90_{name}_ms']:9.2f}  p99 {m[f'p99_{name}_ms']:9.2f}"
        )
    return "\n".join(lines)


async def fetch_model_info(url: str) -> dict:
    """The first model of GET /v1/models: {'id': ..., 'max_model_len': ...?}."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]


def parse_rate(text: str) -> float:
    return math.inf if text.strip().lower() in ("inf", "infinity") else float(text)


def parse_slo(items: list[str]) -> dict[str, float]:
    slo = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"--slo expects METRIC:MS, got {item!r}")
        slo[name.strip()] = float(value)
    return slo


def benchmark_server(
    url: str,
    label: str,
    requests: list[BenchRequest],
    *,
    rates: list[float],
    concurrencies: list[int | None],
    burstiness: float = 1.0,
    slo_ms: dict | None = None,
    seed: int = 0,
    model: str | None = None,
    api_key: str | None = None,
    warmup: int = 1,
    verbose: bool = True,
    warmup_requests: list[BenchRequest] | None = None,
    request_sets: list[list[BenchRequest]] | None = None,
) -> dict:
    """Run every (rate, concurrency) point against one server; -> {'label', 'model', 'runs': [...]}.

    Warm-up sends `warmup_requests` if given, else the first `warmup` of `requests`. Every run
    sends `requests`, or with `request_sets` run i sends `request_sets[i]`: prompts never seen
    before by the server, so its prefix cache carries nothing from the warm-up or earlier runs."""
    model = model or asyncio.run(fetch_model_info(url))["id"]
    warm = warmup_requests if warmup_requests is not None else requests[:warmup]
    if warm:
        asyncio.run(run_load(url, model, warm, api_key=api_key))
    points = [(rate, conc) for rate in rates for conc in concurrencies]
    if request_sets is not None and len(request_sets) < len(points):
        raise ValueError(f"{len(request_sets)} request sets for {len(points)} runs")
    runs = []
    for i, (rate, conc) in enumerate(points):
        run_requests = requests if request_sets is None else request_sets[i]
        results, duration = asyncio.run(
            run_load(
                url,
                model,
                run_requests,
                request_rate=rate,
                burstiness=burstiness,
                max_concurrency=conc,
                seed=seed,
                api_key=api_key,
            )
        )
        metrics = compute_metrics(results, duration, slo_ms)
        errors = sorted({r.error for r in results if r.error})[:3]
        run = {
            "request_rate": "inf" if math.isinf(rate) else rate,
            "max_concurrency": conc,
            "burstiness": burstiness,
            "metrics": metrics,
            "errors": errors,
        }
        runs.append(run)
        if verbose:
            rate_label = f"rate={run['request_rate']} conc={conc or 'unbounded'}"
            print(format_metrics(label, rate_label, metrics), flush=True)
            for e in errors:
                print("  error:", e, flush=True)
    return {"label": label, "url": url, "model": model, "slo_ms": slo_ms or {}, "runs": runs}


def plot_servers(servers: list[dict], path: str | Path, title: str = "") -> None:
    """Latency vs output throughput, one line per server (median TTFT, TPOT and e2e)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("p50_ttft_ms", "median TTFT (ms)"),
        ("p50_tpot_ms", "median TPOT (ms)"),
        ("p50_e2el_ms", "median e2e latency (ms)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for server in servers:
        ms = [r["metrics"] for r in server["runs"]]
        order = np.argsort([m["output_throughput"] for m in ms])
        xs = [ms[i]["output_throughput"] for i in order]
        for ax, (key, _) in zip(axes, panels):
            ax.plot(xs, [ms[i][key] for i in order], marker="o", label=server["label"])
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt/output length")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the server's, else 2048")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt token ids are drawn below this (default: from --tokenizer-dir config.json)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", default="inf", help="comma-separated request rates (req/s) or inf")
    parser.add_argument("--concurrency", default="", help="comma-separated max concurrencies (default unbounded)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1.0 = Poisson")
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="METRIC:MS",
        help="goodput SLO, e.g. --slo ttft:500 --slo tpot:50 (ttft, tpot, e2el)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="requests sent (and ignored) before measuring")
    parser.add_argument("--api-key", default=None)


def requests_from_args(args, server_max_model_len: int | None) -> list[BenchRequest]:
    if args.vocab_size is None:
        raise SystemExit("--vocab-size is required (the checkpoint's vocab_size)")
    max_len = args.max_model_len or server_max_model_len or 2048
    return make_workload(
        args.workload,
        vocab_size=args.vocab_size,
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=max_len,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--label", default=None, help="name of this server in tables and plots")
    parser.add_argument("--model", default=None, help="model name to send (default: first of /v1/models)")
    add_load_arguments(parser)
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--plot", default=None, help="write a latency-vs-throughput PNG here")
    args = parser.parse_args(argv)
    info = asyncio.run(fetch_model_info(args.url))
    requests = requests_from_args(args, info.get("max_model_len"))
    rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()] or [None]
    result = benchmark_server(
        args.url,
        args.label or args.url,
        requests,
        rates=rates,
        concurrencies=concs,
        burstiness=args.burstiness,
        slo_ms=parse_slo(args.slo),
        seed=args.seed,
        model=args.model or info["id"],
        api_key=args.api_key,
        warmup=args.warmup,
    )
    result["workload"] = {"name": args.workload, "scale": args.scale, "seed": args.seed, **summarize(requests)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot_servers([result], args.plot, title=f"{args.workload} workload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
