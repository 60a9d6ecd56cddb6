"""Checkpoint load time: safetensors (HF layout) vs the orbax checkpoint `jaxserve convert` writes.

    python -m benchmarks.load_time [--repeats 3] [--json out.json]
    python -m benchmarks.load_time --processes 2 [--repeats 3] [--json out.json]

Builds random checkpoints (models.random_checkpoint): the tiny test shapes of the dense and
hybrid families, and SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads, vocab 49152; random
weights: load time depends on shapes only), converts each with `convert_checkpoint`, then times
`load_model(...)` until every parameter is on the device (median of `--repeats`, after one warm-up
so both read from the page cache). One process, one device.

`--processes 2`: the same checkpoints loaded by two processes started the way a multi-host
launch starts them (`jax.distributed` on 127.0.0.1, gloo CPU collectives, one CPU device each),
onto a mesh (data 1, model 2) spanning both: safetensors = every process reads the whole file and
places its shards; orbax = every process restores only its own shards. The time of a load is the
slower process's, both starting together after a barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from models.convert import convert_checkpoint
from models.model import load_model
from models.random_checkpoint import write_random_checkpoint

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
CASES = {"tiny-llama": ("llama", {}), "tiny-qwen3_5": ("qwen3_5", {}), "smollm2-135m-shaped": ("llama", SMOLLM2_135M)}


def _timed_load(path: Path, dtype: str, repeats: int, mesh=None) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if mesh is not None:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("load")  # both processes start together
        t0 = time.perf_counter()
        jax.block_until_ready(load_model(path, dtype=dtype, mesh=mesh).params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _worker(args) -> None:
    """One of `--processes` processes: load every case onto a mesh over all processes' devices."""
    from types import SimpleNamespace

    from runtime.parallel.mesh import initialize_multihost, make_mesh

    initialize_multihost(
        SimpleNamespace(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            cpu_devices=1,
        )
    )
    mesh = make_mesh(1, args.processes)
    for name in CASES:
        tmp = Path(args.worker)
        row = {"checkpoint": name, "process": args.process_id}
        for fmt, path in (("safetensors_s", tmp / name), ("orbax_s", tmp / f"{name}-orbax")):
            row[fmt] = _timed_load(path, args.dtype, args.repeats, mesh)
        print("ROW " + json.dumps(row), flush=True)
    jax.distributed.shutdown()


def _run_processes(tmp: str, args) -> dict[str, dict]:
    """Start `--processes` workers over the checkpoints in `tmp`; -> per case the slower process's times."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.load_time",
                "--worker",
                tmp,
                "--port",
                str(port),
                "--processes",
                str(args.processes),
                "--process-id",
                str(pid),
                "--repeats",
                str(args.repeats),
                "--dtype",
                args.dtype,
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for pid in range(args.processes)
    ]
    slowest: dict[str, dict] = {}
    try:
        for p in procs:
            out, _ = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"load-time worker failed with exit code {p.returncode}")
            for line in out.splitlines():
                if line.startswith("ROW "):
                    row = json.loads(line[4:])
                    best = slowest.setdefault(row["checkpoint"], {"safetensors_s": 0.0, "orbax_s": 0.0})
                    for key in best:
                        best[key] = max(best[key], row[key])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return slowest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: the checkpoints' directory
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, overrides) in CASES.items():
            src = write_random_checkpoint(family, Path(tmp) / name, **overrides)
            convert_checkpoint(src, Path(tmp) / f"{name}-orbax", dtype=args.dtype)
        times = (
            _run_processes(tmp, args)
            if args.processes > 1
            else {
                name: {
                    "safetensors_s": _timed_load(Path(tmp) / name, args.dtype, args.repeats),
                    "orbax_s": _timed_load(Path(tmp) / f"{name}-orbax", args.dtype, args.repeats),
                }
                for name in CASES
            }
        )
        for name, t in times.items():
            safetensors_s, orbax_s = t["safetensors_s"], t["orbax_s"]
            rows.append(
                {
                    "checkpoint": name,
                    "dtype": args.dtype,
                    "processes": args.processes,
                    "safetensors_s": round(safetensors_s, 3),
                    "orbax_s": round(orbax_s, 3),
                    "orbax_over_safetensors": round(orbax_s / safetensors_s, 2),
                }
            )
            print(
                f"{name:<22} safetensors {safetensors_s:7.3f} s   orbax {orbax_s:7.3f} s   "
                f"ratio {orbax_s / safetensors_s:.2f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
