"""Where the CPU goes behind our server: tokens/s and CPU seconds per thread, two source trees alternated.

    python -m benchmarks.server_cpu .cache/peers/tiny-llama --trees before=/tmp/old after=. \
        --num-requests 400 --repeats 2 --json server-cpu.json

On a 2-core CPU the HTTP event loop, the engine loop, XLA's thread pool and the load generator
share two cores, so every CPU second the server's Python spends is taken from the model. Per
(repeat, tree), trees alternated: our server from that tree (`cwd` = the tree, bf16, the
saturation cases' limits: 16 sequences, 512 batched tokens, max_model_len 2048) is started and
warmed up, then `benchmarks.serve` sends `--num-requests` requests of the `mixed` workload
(scale 0.25) at concurrency 16; the CPU seconds of each of the server's threads
(`/proc/<pid>/task/*/stat`, user + system, the engine's child process included) and of the
client are read around that run. Threads: `http` the main thread (aiohttp's event loop),
`engine` the engine loop (the largest other Python thread: the engine process's main thread, or
the loop thread with `server.engine_process=false`), `xla` XLA's intra-op pool (`tf_XLAEigen*`),
`other` the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peers, write_json

PORT = 18750


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the engine process, multiprocessing's resource tracker)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds) for every thread of `pid` and its child processes."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for proc in process_tree(pid):
        for tid in os.listdir(f"/proc/{proc}/task"):
            try:
                name = Path(f"/proc/{proc}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{proc}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # a thread that just ended
                continue
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _classify(pid: int, before: dict, after: dict) -> dict[str, float]:
    """`http`: the server's main thread; `engine`: the engine loop, i.e. the Python thread (not
    XLA's) with the most CPU other than `http` -- the engine process's main thread, or with
    `server.engine_process=false` the loop thread; `xla`: XLA's pools; `other`: the rest."""
    deltas = {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}
    groups = {"http": 0.0, "engine": 0.0, "xla": 0.0, "other": 0.0}
    python = sorted(
        ((d, tid) for tid, (name, d) in deltas.items() if tid != pid and not name.startswith("tf_")), reverse=True
    )
    engine_tid = python[0][1] if python else None
    for tid, (name, d) in deltas.items():
        key = (
            "http"
            if tid == pid
            else "xla"
            if name.startswith("tf_XLAEigen")
            else "engine"
            if tid == engine_tid
            else "other"
        )
        groups[key] += d
    return groups


def _load(url: str, num_requests: int, seed: int, out: Path, vocab: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serve",
        "--url",
        url,
        "--workload",
        "mixed",
        "--scale",
        "0.25",
        "--vocab-size",
        str(vocab),
        "--num-requests",
        str(num_requests),
        "--concurrency",
        "16",
        "--warmup",
        "0",
        "--seed",
        str(seed),
        "--json",
        str(out),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = json.loads(out.read_text())["runs"][0]["metrics"]
    client = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "output_throughput": run["output_throughput"],
        "p99_tpot_ms": run["p99_tpot_ms"],
        "median_ttft_ms": run["median_ttft_ms"],
        "client_cpu_s": client,
    }


def run_tree(tree: str, checkpoint: str, num_requests: int, seed: int, work: Path) -> dict:
    url = f"http://127.0.0.1:{PORT}"
    cmd = peers.jaxserve_serve_command(
        checkpoint,
        PORT,
        max_model_len=2048,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        dtype="bfloat16",
        compile_cache_dir=str(work / "jax-cache"),
    )
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    with peers.running_server(cmd, url, work / "server.log", env=env, cwd=Path(tree).resolve()) as proc:
        _load(url, 32, seed=9000, out=work / "warmup.json", vocab=vocab)
        before, t0 = _thread_cpu(proc.pid), time.perf_counter()
        result = _load(url, num_requests, seed=seed, out=work / "run.json", vocab=vocab)
        wall = time.perf_counter() - t0
        cpu = _classify(proc.pid, before, _thread_cpu(proc.pid))
    tokens = result["output_throughput"] * wall
    return {
        **result,
        "wall_s": wall,
        "server_cpu_s": cpu,
        "server_python_us_per_token": 1e6 * (cpu["http"] + cpu["engine"]) / tokens,
        "http_us_per_token": 1e6 * cpu["http"] / tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--trees", nargs="+", default=["this=."], help="name=path pairs, alternated in this order")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees)
    checkpoint = str(Path(args.checkpoint).resolve())
    runs = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="server-cpu-") as tmp:
        for rep in range(args.repeats):
            for name, tree in trees.items():
                r = run_tree(tree, checkpoint, args.num_requests, seed=1000 + rep, work=Path(tmp) / name)
                runs[name].append(r)
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["server_cpu_s"].items())
                print(
                    f"rep {rep} {name}: {r['output_throughput']:.0f} tok/s, p99 TPOT {r['p99_tpot_ms']:.1f} ms, "
                    f"CPU s: {cpu}, client {r['client_cpu_s']:.2f}; HTTP {r['http_us_per_token']:.0f} us/token",
                    flush=True,
                )
    median = {
        name: {
            k: statistics.median(r[k] for r in rs)
            for k in (
                "output_throughput",
                "p99_tpot_ms",
                "median_ttft_ms",
                "http_us_per_token",
                "server_python_us_per_token",
                "client_cpu_s",
            )
        }
        for name, rs in runs.items()
    }
    write_json(
        args.json,
        {"checkpoint": checkpoint, "trees": trees, "num_requests": args.num_requests, "median": median, "runs": runs},
    )
    for name, m in median.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
