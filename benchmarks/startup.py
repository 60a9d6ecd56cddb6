"""Start-up compile: executables and seconds with the buckets only (`aot_compile`) vs every
variant a step can ask for, sealed (`aot_compile_all`, what `jaxserve serve` with `compile.aot`
does), per checkpoint, in one invocation.

    python -m benchmarks.startup .cache/peers/tiny-llama .cache/peers/qwen3_5-small --json out.json

Engines as `jaxserve serve` builds them from `cpu-demo.yaml` (float32, max_num_seqs 8,
max_num_batched_tokens 256, max_model_len 2048, CPU plan defaults) but without the persistent
compilation cache: every compile is cold. The engine's
constructor time (load + compile) and the executables it compiled.
"""

from __future__ import annotations

import argparse
import json
import time


def start(checkpoint: str, every_variant: bool, args) -> dict:
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            dtype="float32",
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            aot_compile=True,
            aot_compile_all=every_variant,
        ),
        progress=False,
    )
    seconds = time.perf_counter() - t0
    compiled = engine.executables.compile_seconds
    return dict(
        checkpoint=checkpoint,
        every_variant=every_variant,
        executables=len(compiled),
        compile_s=sum(compiled.values()),
        start_s=seconds,
        names=list(compiled),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for checkpoint in args.checkpoints:
        for every_variant in (False, True):
            row = start(checkpoint, every_variant, args)
            rows.append(row)
            print(
                f"{checkpoint:<40} {'every variant' if every_variant else 'buckets only':<14} "
                f"{row['executables']:>3} executables, compile {row['compile_s']:6.1f} s, start {row['start_s']:6.1f} s",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
