"""Attention data parallelism: steps and tokens per step of one saturated workload per mesh.

    python -m benchmarks.data_parallel [--requests 32] [--out benchmarks/results/NAME/data_parallel.json]

Each mesh (data D x model 8/D over 8 simulated CPU devices, one subprocess each) serves the same
greedy workload (tiny random Llama, prompts of 24-64 tokens, 16 output tokens) with the same
per-rank limits (max_num_seqs 4, max_num_batched_tokens 32). Reported: engine steps to finish,
mean and max tokens per step (engine stats), and the ratios to data 1. On simulated devices all
"devices" share the host's cores, so wall time says nothing about a real mesh; the step counts
and tokens per step are what DP changes (D ranks each fill their own per-rank budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

RUN = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    path, data, num_requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = LLMEngine(EngineConfig(
        model=path, page_size=16, num_pages=64 * data, max_num_seqs=4, max_num_batched_tokens=32,
        token_buckets=(8, 16, 32), max_model_len=96, load_tokenizer=False, enable_prefix_caching=False,
        mesh_shape=(data, 8 // data)))
    rng = np.random.default_rng(0)
    fed = 0  # tokens every request feeds: its prompt and all its outputs but the last
    for i in range(num_requests):
        prompt = rng.integers(3, 1000, int(rng.integers(24, 65))).tolist()
        fed += len(prompt) + 16 - 1
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0,
                                                                         ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_preemptions"] == 0, "the pool is sized so that nothing is recomputed"
    print("RESULT " + json.dumps({"data": data, "model": 8 // data, "steps": engine.num_steps,
                                  "mean_tokens_per_step": fed / engine.num_steps,
                                  "max_tokens_per_step": stats.get("max_tokens_per_step", "<= 32 (one rank)")}))
""")


def run_mesh(path: str, data: int, num_requests: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, path, str(data), str(num_requests)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(line[len("RESULT ") :])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--data", default="1,2,4", help="data axis sizes to run (model = 8 / data)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from models.random_checkpoint import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            write_random_checkpoint(
                "llama", Path(tmp) / "llama", num_attention_heads=8, num_key_value_heads=8, vocab_size=1032
            )
        )
        rows = [run_mesh(path, int(d), args.requests) for d in args.data.split(",")]
    base = rows[0]
    for row in rows:
        row["steps_ratio_vs_first"] = row["steps"] / base["steps"]
        row["tokens_per_step_ratio_vs_first"] = row["mean_tokens_per_step"] / base["mean_tokens_per_step"]
        print(json.dumps(row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
