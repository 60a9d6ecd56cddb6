"""The quality cost of bfloat16 GDN state slots (`cache.state_dtype`), measured against float32.

    python -m benchmarks.state_dtype_quality            # -> benchmarks/results/state-dtype/quality-cpu-2core.json
    python -m benchmarks.state_dtype_quality --decode 64 --prompts 1 --plan '' --json /tmp/q.json   # quick

Per tiny hybrid (the Qwen3.5-style `qwen3_5` and Qwen3-Next-style `qwen3_next` random checkpoints,
benchmarks/tiny_checkpoints.py) and per model dtype (float32, the CPU default; bfloat16, the
accelerator configs'):

teacher-forced  One prefill of a random prompt, then `--decode` one-token decode steps through the
                paged caches, the serving forward pass (`models.transformer.forward`) with the CPU
                kernels. The float32-state run picks its greedy tokens; the bfloat16-state run is fed
                the same tokens, so both see one history and differ only in the state slots (read
                and rounded back to bf16 every step: the rounding compounds over the decode). Per
                step: KL(p_f32 || p_bf16) over the full vocabulary and top-1 agreement; reported as
                the mean, the max, and the mean over the last 64 steps (does the error grow?).
free-running    The engine (`runtime.LLM`, this machine's plan) generating `--decode` greedy tokens
                for the same prompts with each state dtype, batched: tokens equal until the first
                divergence, and the fraction of positions equal.
reference       (`--reference`, its own file) the yardstick: a bfloat16 model vs the float32 model,
                both with float32 state, teacher-forced the same way.
plan            `jaxserve plan`'s memory budget (runtime/aot/chip_report.py, no compile) of the shipped
                hybrid configs with each state dtype: a slot's bytes per device, state and KV memory.

The default model (SmolLM2-135M-Instruct, models/default_model.py) is a Llama: no recurrent state,
so not measured. Random weights give flat, near-tied logits, where a small logit error flips the
argmax more easily than in a trained model: the agreement figures are pessimistic, the KL is the
number to compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "state-dtype" / "quality-cpu-2core.json"
FAMILIES = ("qwen3_5", "qwen3_next")
TAIL = 64  # the last steps' mean KL, against the mean over all steps


@functools.cache
def _step(cfg, opts):
    import jax
    import jax.numpy as jnp

    from models.transformer import compute_logits, forward

    def run(params, caches, batch):
        hidden, caches = forward(params, caches, batch, cfg=cfg, opts=opts)
        return caches, compute_logits(params, hidden, cfg.final_logit_softcapping)[0].astype(jnp.float32)

    return jax.jit(run, donate_argnums=1)


def decode_logits(model, prompt: list[int], steps: int, forced: list[int] | None = None, page_size: int = 16):
    """Logits [steps, V] after the prompt and after each of steps - 1 decode tokens: `forced`'s,
    or the run's own greedy tokens. The loop of `models.model.Model.greedy`, keeping the logits."""
    from models.batch import decode_batch, single_sequence_batch
    from models.ops import KernelOptions
    from models.padding import SEQUENCE_PAD_MIN, pow2_bucket

    step = _step(model.cfg, KernelOptions())
    total = len(prompt) + steps
    full = single_sequence_batch(list(range(total)), page_size)
    padded = pow2_bucket(len(prompt), SEQUENCE_PAD_MIN)
    caches = model.init_caches(2 + (padded + steps) // page_size, page_size, num_slots=2)
    batch = dataclasses.replace(
        single_sequence_batch(prompt, page_size, pad_to=padded),
        block_tables=full.block_tables,
        logits_indices=np.array([len(prompt) - 1], np.int32),
    )
    out = []
    for i in range(steps):
        caches, logits = step(model.params, caches, batch)
        out.append(np.asarray(logits))
        token = int(np.argmax(out[-1])) if forced is None else forced[i]
        batch = decode_batch(full, token, len(prompt) + i)
    return np.stack(out)


def kl_per_step(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) per row, in float64."""
    a, b = ref_logits.astype(np.float64), logits.astype(np.float64)
    log_p = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    log_q = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    return np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)


def teacher_forced(path: Path, dtype: str, prompts: list[list[int]], steps: int) -> dict:
    from models.model import load_model

    model = load_model(path, dtype=dtype)
    kls, agree, rows = [], [], []
    for prompt in prompts:
        model.state_dtype = "float32"
        ref = decode_logits(model, prompt, steps)
        model.state_dtype = "bfloat16"
        forced = [int(t) for t in np.argmax(ref, axis=-1)]
        got = decode_logits(model, prompt, steps, forced=forced)
        kl = kl_per_step(ref, got)
        same = np.argmax(got, axis=-1) == np.argmax(ref, axis=-1)
        kls.append(kl)
        agree.append(same)
        rows.append(
            {
                "prompt_len": len(prompt),
                "mean_kl": float(kl.mean()),
                "max_kl": float(kl.max()),
                "tail_mean_kl": float(kl[-TAIL:].mean()),
                "top1_agreement": float(same.mean()),
                "max_abs_logit_diff": float(np.abs(got - ref).max()),
            }
        )
    kl, same = np.concatenate(kls), np.concatenate(agree)
    return {
        "steps_per_prompt": steps,
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "tail_mean_kl": float(np.mean([k[-TAIL:].mean() for k in kls])),
        "head_mean_kl": float(np.mean([k[:TAIL].mean() for k in kls])),
        "top1_agreement": float(same.mean()),
        "prompts": rows,
    }


def model_dtype_reference(path: Path, prompts: list[list[int]], steps: int) -> dict:
    """The yardstick: a bfloat16 model vs the float32 model, both with float32 state, teacher-forced
    the same way (what bf16 weights and activations alone cost)."""
    from models.model import load_model

    f32, bf16 = load_model(path, dtype="float32"), load_model(path, dtype="bfloat16")
    kls, agree = [], []
    for prompt in prompts:
        ref = decode_logits(f32, prompt, steps)
        got = decode_logits(bf16, prompt, steps, forced=[int(t) for t in np.argmax(ref, axis=-1)])
        kls.append(kl_per_step(ref, got))
        agree.append(np.argmax(got, axis=-1) == np.argmax(ref, axis=-1))
    kl, same = np.concatenate(kls), np.concatenate(agree)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(same.mean())}


def free_running(path: Path, dtype: str, prompts: list[list[int]], steps: int) -> dict:
    from runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    tokens = {}
    for state_dtype in ("float32", "bfloat16"):
        llm = LLM(
            str(path),
            dtype=dtype,
            state_dtype=state_dtype,
            max_model_len=max(len(p) for p in prompts) + steps + 16,
            max_num_seqs=max(len(prompts), 1),
            aot_compile=False,
        )
        rec = llm.engine.caches["rec"]
        assert all(r is None or str(r.dtype) == state_dtype for r in rec), "state slots in the wrong dtype"
        tokens[state_dtype] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        del llm
    rows = []
    for a, b in zip(tokens["float32"], tokens["bfloat16"]):
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        rows.append({"first_divergence": diverge, "equal_fraction": float(np.mean(np.array(a) == np.array(b)))})
    return {
        "max_tokens": steps,
        "first_divergence": [r["first_divergence"] for r in rows],
        "identical_sequences": sum(r["first_divergence"] == steps for r in rows),
        "equal_fraction": float(np.mean([r["equal_fraction"] for r in rows])),
    }


def plan_rows(configs: list[str]) -> list[dict]:
    """`jaxserve plan`'s budget (no compile) of each shipped hybrid config with float32 and bfloat16
    state: one slot's bytes per device, the state and KV memory, the pages the budget leaves."""
    from configs.schema import CONFIG_DIR, load_config
    from runtime.aot.chip_report import plan_config

    rows = []
    for name in configs:
        for state_dtype in ("float32", "bfloat16"):
            launch = load_config(CONFIG_DIR / name, {"cache.state_dtype": state_dtype})
            r = plan_config(launch, name, token_buckets=(), compile_sampler=False)
            rows.append(
                {
                    "config": name,
                    "state_dtype": state_dtype,
                    "max_num_seqs": r.max_num_seqs,
                    "state_bytes_per_slot_per_device": r.state_bytes_per_slot,
                    "num_state_slots": r.num_state_slots,
                    "num_checkpoint_slots": r.num_checkpoint_slots,
                    "state_bytes_per_device": r.state_bytes,
                    "kv_bytes_per_device": r.kv_bytes,
                    "num_pages": r.num_pages,
                    "kv_tokens": (r.num_pages - 1) * r.page_size,
                    "fits": r.fits,
                }
            )
    return rows


PLANNED = (
    "tpu-v5e-8-qwen3_5-27b.yaml",
    "tpu-v5e-8-qwen3_5-27b-decode.yaml",
    "tpu-v5e-8-qwen3_5-27b-prefill.yaml",
    "tpu-v5p-16-qwen3-next-80b-multihost.yaml",
    "gpu-h200-qwen3_5-9b.yaml",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--decode", type=int, default=512, help="decode steps per prompt")
    parser.add_argument("--no-engine", action="store_true", help="skip the free-running engine runs")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="only the yardstick: bf16 vs f32 model, f32 state (model_dtype_reference)",
    )
    parser.add_argument("--plan", default=",".join(PLANNED), help="shipped configs to plan ('' for none)")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)

    import jax

    from benchmarks.tiny_checkpoints import build_cached_checkpoint
    from models.config import parse_config
    from models.safetensors_io import read_json

    results = []
    for family in args.families.split(","):
        path = build_cached_checkpoint(family)
        vocab = parse_config(read_json(path / "config.json")).vocab_size
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
        if args.reference:
            row = {"family": family, "bf16_model_vs_f32_model": model_dtype_reference(path, prompts, args.decode)}
            print(family, row["bf16_model_vs_f32_model"], flush=True)
            results.append(row)
            continue
        for dtype in args.dtypes.split(","):
            start = time.perf_counter()
            row = {
                "family": family,
                "model_dtype": dtype,
                "teacher_forced": teacher_forced(path, dtype, prompts, args.decode),
            }
            if not args.no_engine:
                row["free_running"] = free_running(path, dtype, prompts, args.decode)
            row["seconds"] = round(time.perf_counter() - start, 1)
            tf = row["teacher_forced"]
            print(
                f"{family:10s} {dtype:8s} mean KL {tf['mean_kl']:.2e} (first {TAIL} steps {tf['head_mean_kl']:.2e}, "
                f"last {TAIL} {tf['tail_mean_kl']:.2e}), max {tf['max_kl']:.2e}, top-1 agreement "
                f"{tf['top1_agreement']:.4f}"
                + (
                    f"; engine greedy: first divergence {row['free_running']['first_divergence']}"
                    if "free_running" in row
                    else ""
                ),
                flush=True,
            )
            results.append(row)
    out = {
        "what": "bfloat16 vs float32 GDN state slots (cache.state_dtype) on the tiny hybrids",
        "command": "python -m benchmarks.state_dtype_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {jax.default_backend()} (the 2-core CPU box)",
        "jax": jax.__version__,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode,
        "default_model": "SmolLM2-135M-Instruct is a Llama (no recurrent state): not measured",
        "results": results,
        "plan": [] if args.reference else plan_rows([c for c in args.plan.split(",") if c]),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
