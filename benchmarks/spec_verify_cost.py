"""MTP verification cost per step vs a plain decode step, on a random Qwen3.5-shaped checkpoint.

    python -m benchmarks.spec_verify_cost --shape tiny \
        --json benchmarks/results/spec-decode/verify-cost-cpu-2core-tiny.json
    python -m benchmarks.spec_verify_cost --shape qwen3_5-9b-8layers --checkpoint /tmp/qwen3_5-9b-shape \
        --json $OUT/verify-cost-gpu-qwen3_5-9b-8layers.json       # benchmarks/gpu_check.sh, stage spec_verify_cost

The checkpoint (random weights with the MTP layer, models/random_mtp.py) is built locally from the
`--shape` preset, or reused from `--checkpoint` when that directory holds one. One engine runs
without speculation ("plain") and one per k with `speculative_config: {method: mtp,
num_speculative_tokens: k}`. For each batch size B the engine is given B greedy requests and
stepped until all B decode; the next step's compiled calls are captured with their real inputs
(the request table, the step's rows, prev tokens; the verify step's `VerifyRows`) and replayed
`--repeats` times after `--warmup` runs, each blocked on (block_until_ready), median and p90:

  plain    the decode step: prepare + forward of B rows + sampling (the fused greedy backbone, or
           backbone + sampler, whichever the engine runs), T = B
  verify   the MTP verify step: prepare + k MTP draft steps + forward of B (k + 1) rows + per-row
           sampling + acceptance + the GDN replay of the accepted prefix, T = B (k + 1)

Token buckets include exactly B and B (k + 1) (besides powers of two), so no padding enters the ratio.
max_num_seqs is the largest B (`--max-batch`): the verify step's per-sequence work (the MTP's k draft
steps, acceptance, the GDN replay) runs over the step's sequence bucket (the smallest of the engine's
seq buckets holding B, at least 8: runtime/speculative/verify.py `seq_rows`); the table and the
forward pass keep max_num_seqs rows. The ratio
r = verify / plain is the step's cost in plain steps; a verify step emits 1 + a tokens (a: its
accepted drafts), a plain step 1, so speculation pays when 1 + a > r:

    break-even accepted drafts per step   a* = r - 1
    break-even per-draft acceptance (i.i.d., a = alpha + ... + alpha^k)   alpha* solving that = r - 1

`--e2e-max-batch N` adds end-to-end tokens/s for B <= N: the plain engine vs the MTP engine with
oracle drafts (the plain engine's own greedy output: every draft accepted, the MTP layer still
drafting each step; benchmarks/spec_decode.py `propose_from`), the same text checked.
`--full-rows`: each verify step is also replayed with its sequence rows padded to max_num_seqs (the
verify executables' layout before they took the step's sequence bucket), interleaved with the
bucketed one on the same caches (`full_rows_median_s`: the A/B of one process under one load).
`--dry-run`: k = 1, B = 1, one warm-up and one repeat (checks the path end to end).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import write_json

_QWEN3_5_9B = dict(  # Qwen3.5-9B's layer shapes (benchmarks/gpu_check.sh builds the same 8-layer checkpoint)
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vocab_size=248320,
    max_position_embeddings=32768,
)
_GROUP = ["linear_attention"] * 3 + ["full_attention"]  # its 4-layer group: 3 GDN + 1 attention
SHAPES = {  # name -> (checkpoint overrides or None: the tests' tiny qwen3_5, dtype, prompt length)
    "tiny": (None, "float32", 32),
    "qwen3_5-9b-4layers": ({**_QWEN3_5_9B, "num_hidden_layers": 4, "layer_types": _GROUP}, "bfloat16", 256),
    "qwen3_5-9b-8layers": ({**_QWEN3_5_9B, "num_hidden_layers": 8, "layer_types": _GROUP * 2}, "bfloat16", 256),
}


def checkpoint_for(shape: str, path: Path | None) -> str:
    """The shape's checkpoint: `path` when it holds one (with its MTP layer), else built there
    (default /tmp/jaxserve-<shape>); `tiny`: the tests' cached tiny qwen3_5."""
    overrides, dtype, _ = SHAPES[shape]
    if overrides is None and path is None:
        from benchmarks.tiny_checkpoints import build_cached_checkpoint

        return str(build_cached_checkpoint("qwen3_5"))
    path = path or Path(f"/tmp/jaxserve-{shape}")
    if not (path / "config.json").exists():
        from models.random_checkpoint import write_random_checkpoint

        t0 = time.perf_counter()
        write_random_checkpoint("qwen3_5", path, dtype=dtype, std=0.02, **(overrides or {}))
        print(f"checkpoint {shape} written to {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    if not (path / "mtp.safetensors").exists():
        raise SystemExit(f"{path} has no mtp.safetensors (models/random_mtp.py): not an MTP checkpoint")
    return str(path)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def break_even_alpha(a_star: float, k: int) -> float | None:
    """The per-draft acceptance alpha with alpha + alpha^2 + ... + alpha^k = a_star (i.i.d.
    acceptance, a sequence's drafts accepted up to the first rejection); None past k."""
    if a_star <= 0:
        return 0.0
    if a_star >= k:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, k + 1)) < a_star else (lo, mid)
    return (lo + hi) / 2


class StepCapture:
    """Wraps an engine's `_dispatch`: the first step with `batch` sequences all decoding (each
    1 + k tokens, k drafts) is dispatched as usual with its compiled calls recorded, then those
    calls are replayed `warmup + repeats` times on the engine's caches (donated and handed back)."""

    def __init__(self, engine, k: int, batch: int, warmup: int, repeats: int, full_rows: bool = False):
        self.engine, self.k, self.batch, self.warmup, self.repeats = engine, k, batch, warmup, repeats
        self.times: list[float] | None = None
        self.full_rows = full_rows  # a verify step: also its sequence rows padded to max_num_seqs, interleaved
        self.full_times: list[float] = []
        self.error: BaseException | None = None
        self.kind = None
        self._dispatch = engine._dispatch
        engine._dispatch = self

    def close(self):
        self.engine._dispatch = self._dispatch

    def _decoding(self, out) -> bool:
        return len(out.sequences) == self.batch and all(
            s.num_new_tokens == 1 + self.k and s.num_draft == self.k and s.sample for s in out.sequences
        )

    def __call__(self, out):
        if self.times is not None or not self._decoding(out):
            return self._dispatch(out)
        calls, ex = [], self.engine.executables
        spec = self.engine.speculator
        wrapped = {"run_table_greedy_backbone": ex, "run_table_backbone": ex, "run_sampler": ex}
        if spec is not None:
            wrapped = {"run": spec.verify}
        originals = {name: getattr(obj, name) for name, obj in wrapped.items()}
        for name, obj in wrapped.items():

            def record(*args, _name=name, **kwargs):
                calls.append((_name, args, kwargs))
                return originals[_name](*args, **kwargs)

            setattr(obj, name, record)
        try:
            result = self._dispatch(out)
        finally:
            for name, obj in wrapped.items():
                delattr(obj, name)  # the class's method again
        try:
            self.times = self._replay(calls, originals)
        except BaseException as err:  # the engine turns a raise into a failed step: keep it for the caller
            self.error, self.times = err, []
        return result

    def _replay(self, calls, fns) -> list[float]:
        import jax

        names = [c[0] for c in calls]
        self.kind = "+".join(names)
        if names not in (["run"], ["run_table_greedy_backbone"], ["run_table_backbone", "run_sampler"]):
            raise RuntimeError(f"unexpected decode step calls {names}")
        engine, times = self.engine, []
        caches = engine.caches  # the captured step's output caches (its input ones were donated)
        full = full_rows_call(calls[0], engine) if self.full_rows and names == ["run"] else None
        for i in range(self.warmup + self.repeats):
            for call, record in ((calls[0], times), (full, self.full_times))[:: 1 if i % 2 else -1]:
                if call is None:
                    continue
                t0 = time.perf_counter()
                name, args, kwargs = call
                outs = fns[name](args[0], caches, *args[2:], **kwargs)
                caches = outs[0]
                if len(calls) == 2:  # backbone, then the sampler on its hidden states
                    _, sargs, skw = calls[1]
                    outs = (caches, fns["run_sampler"](sargs[0], outs[2], *sargs[2:], **skw))
                jax.block_until_ready(outs)
                if i >= self.warmup:
                    record.append(time.perf_counter() - t0)
        engine.caches = caches
        return times


def full_rows_call(call, engine):
    """The captured verify call with its sequence rows padded to max_num_seqs (the layout before
    the verify executables took the step's sequence bucket); None when already there."""
    import dataclasses

    name, args, kwargs = call
    verify, S = args[3], engine.config.max_num_seqs
    if verify.num_draft.shape[0] >= S or any(a is not None for a in args[5:6] + args[7:8]):
        return None  # (a penalty or grammar step: not padded here)
    num_draft = np.zeros(S, np.int32)
    num_draft[: verify.num_draft.shape[0]] = np.asarray(verify.num_draft)
    return name, (*args[:3], dataclasses.replace(verify, num_draft=num_draft), *args[4:]), kwargs


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, min(vocab, 32000) - 3, size=length).tolist() for _ in range(n)]


def time_step(engine, k: int, batch: int, args, vocab: int) -> dict:
    """Median / p90 seconds of the engine's decode step (k = 0) or verify step at `batch`."""
    from runtime.types import EngineRequest, SamplingParams

    prompt_len, warmup, repeats = args.prompt_len, args.warmup, args.repeats
    params = SamplingParams(max_tokens=args.max_model_slack - 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}k{k}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(EngineRequest(rid, prompt, params))
    capture = StepCapture(engine, k, batch, warmup, repeats, getattr(args, "full_rows", False) and k > 0)
    try:
        for _ in range(10_000):
            engine.step()
            if capture.times is not None:
                break
    finally:
        capture.close()
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    if capture.error is not None:
        raise capture.error
    if capture.times is None:
        raise RuntimeError(f"no step with {batch} sequences all decoding (k={k})")
    ts, full = capture.times, capture.full_times
    out = {"median_s": statistics.median(ts), "p90_s": percentile(ts, 90), "calls": capture.kind, "times_s": ts}
    if full:  # the same step with max_num_seqs sequence rows, interleaved with the one above
        out.update(
            full_rows_median_s=statistics.median(full), full_rows_p90_s=percentile(full, 90), full_rows_times_s=full
        )
    return out


def build_engine(checkpoint: str, dtype: str, k: int, args, buckets: list[int]):
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig

    spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}
    max_len = args.prompt_len + args.max_model_slack
    page_size = args.page_size
    return LLMEngine(
        EngineConfig(
            model=checkpoint,
            dtype=dtype,
            max_model_len=max_len,
            max_num_seqs=args.max_batch,
            max_num_batched_tokens=buckets[-1],
            token_buckets=tuple(buckets),
            num_pages=args.max_batch * -(-max_len // page_size) + 2,
            page_size=page_size,
            seed=0,
            enable_prefix_caching=False,
            aot_compile=False,  # only the buckets the run reaches compile (on first use)
            speculative_config=spec,
            fuse_greedy={"auto": None, "on": True, "off": False}[args.fuse_greedy],
        )
    )


def e2e(engine, prompts, oracle=None, max_tokens: int = 32) -> dict:
    """Output tokens/s of `prompts` run to `max_tokens` each (warm-up run first)."""
    from benchmarks.spec_decode import propose_from, run

    if oracle is not None:
        engine.speculator.propose = functools.partial(propose_from, oracle, engine.speculator, mtp=True)
    run(engine, prompts, max_tokens)
    return run(engine, prompts, max_tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--checkpoint", type=Path, help="reuse (or build) the shape's checkpoint here")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--max-batch", type=int, default=64, help="caps --batches (max_num_seqs)")
    ap.add_argument("--ks", default="1,2,4", help="num_speculative_tokens values")
    ap.add_argument("--prompt-len", type=int, help="default: the shape's")
    ap.add_argument("--max-model-slack", type=int, default=256, help="max_model_len = prompt + this")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--e2e-max-batch", type=int, default=0, help="end-to-end oracle rows for B <= this")
    ap.add_argument("--e2e-tokens", type=int, default=32)
    ap.add_argument("--fuse-greedy", choices=("auto", "on", "off"), default="auto", help="the plain greedy step")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size (the H200 config's: 64)")
    ap.add_argument(
        "--full-rows", action="store_true", help="also time each verify step padded to max_num_seqs sequence rows"
    )
    ap.add_argument("--dry-run", action="store_true", help="k 1, batch 1, one warm-up, one repeat")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import jax

    overrides, dtype, default_prompt = SHAPES[args.shape]
    args.prompt_len = args.prompt_len or default_prompt
    ks, batches = [int(x) for x in args.ks.split(",")], [int(x) for x in args.batches.split(",")]
    if args.dry_run:
        ks, batches, args.warmup, args.repeats = [1], [1], 1, 1
    batches = [b for b in batches if b <= args.max_batch]
    args.max_batch = max(batches)
    prefill = max(512, args.max_batch * (max(ks) + 1))
    # powers of two as the default engine's (the e2e rows' steps), plus the exact B and B (k + 1)
    pow2 = {1 << i for i in range(prefill.bit_length()) if 1 << i < prefill}
    checkpoint = checkpoint_for(args.shape, args.checkpoint)
    load_before, t_start = os.getloadavg(), time.perf_counter()
    vocab = (overrides or {}).get("vocab_size", 1031)

    t0 = time.perf_counter()
    plain = build_engine(checkpoint, dtype, 0, args, sorted(pow2 | set(batches) | {prefill}))
    ready = {"plain": time.perf_counter() - t0}
    print(f"plain engine ready in {ready['plain']:.1f}s", flush=True)
    rows = {b: {"batch": b, "plain": time_step(plain, 0, b, args, vocab)} for b in batches}
    for b in batches:
        print(f"B={b}: plain {rows[b]['plain']['median_s'] * 1e3:.2f} ms ({rows[b]['plain']['calls']})", flush=True)
    e2e_batches = [b for b in batches if b <= args.e2e_max_batch]
    oracle, references = None, {}
    if e2e_batches:
        from benchmarks.spec_decode import OracleDrafts

        oracle = OracleDrafts()
        for b in e2e_batches:
            prompts = random_prompts(b, args.prompt_len, vocab, seed=1000 + b)
            references[b] = (prompts, e2e(plain, prompts, max_tokens=args.e2e_tokens))
            oracle.continuations += [p + t for p, t in zip(prompts, references[b][1]["tokens"])]
            rows[b]["e2e_plain_tokens_per_s"] = references[b][1]["tokens_per_s"]

    def save(done: list[int]) -> None:  # after each engine: a timed-out run keeps what it measured
        device = jax.devices()[0]
        report = {
            "shape": args.shape,
            "checkpoint": checkpoint if args.checkpoint else f"built from --shape {args.shape}",
            "checkpoint_overrides": overrides,
            "dtype": dtype,
            "page_size": args.page_size,
            "fuse_greedy": args.fuse_greedy,
            "max_num_seqs": args.max_batch,  # the table's rows (the verify step's per-sequence work: B's seq bucket)
            "device": f"{device.platform}: {device.device_kind}",
            "prompt_len": args.prompt_len,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "ks": ks,
            "ks_done": done,
            "complete": done == ks,
            "engine_ready_s": ready,
            "batches": batches,
            "formula": "ratio r = verify median / plain median (one step each); a verify step emits 1 + a tokens "
            "(a accepted drafts), a plain step 1: speculation pays when a > r - 1 (break_even_accepted_per_step); "
            "break_even_per_draft_acceptance: alpha with alpha + ... + alpha^k = r - 1 (null: r - 1 >= k, never pays)",
            "e2e_note": "oracle drafts: the plain engine's own greedy output (every draft accepted, the MTP layer "
            "still drafting each step): the ceiling of a well-trained MTP layer"
            if e2e_batches
            else None,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "cpu_count": os.cpu_count(),
            "wall_s": time.perf_counter() - t_start,
            "rows": [rows[b] for b in batches],
        }
        write_json(args.json, report)

    save([])
    for k in ks:
        t0 = time.perf_counter()
        engine = build_engine(checkpoint, dtype, k, args, sorted(pow2 | {b * (k + 1) for b in batches} | {prefill}))
        ready[f"mtp_k{k}"] = time.perf_counter() - t0
        print(f"mtp k={k} engine ready in {ready[f'mtp_k{k}']:.1f}s", flush=True)
        for b in batches:
            v = time_step(engine, k, b, args, vocab)
            r = v["median_s"] / rows[b]["plain"]["median_s"]
            entry = {
                **v,
                "ratio_median": r,
                "ratio_p90": v["p90_s"] / rows[b]["plain"]["p90_s"],
                "break_even_accepted_per_step": r - 1,
                "break_even_per_draft_acceptance": break_even_alpha(r - 1, k),
            }
            if b in references:
                prompts, ref = references[b]
                got = e2e(engine, prompts, oracle, args.e2e_tokens)
                entry["e2e_oracle_tokens_per_s"] = got["tokens_per_s"]
                entry["e2e_oracle_speedup"] = got["tokens_per_s"] / ref["tokens_per_s"]
                entry["e2e_identical_text"] = got["tokens"] == ref["tokens"]
                entry["e2e_accepted_per_draft"] = got["spec_decode_num_accepted_tokens"] / max(
                    1, got["spec_decode_num_draft_tokens"]
                )
            rows[b][f"mtp_k{k}"] = entry
            print(
                f"B={b} k={k}: verify {v['median_s'] * 1e3:.2f} ms, x{r:.2f} plain, break-even {r - 1:.2f} accepted"
                + (f", e2e oracle x{entry['e2e_oracle_speedup']:.2f}" if "e2e_oracle_speedup" in entry else "")
                + (f"; max_num_seqs rows {v['full_rows_median_s'] * 1e3:.2f} ms" if "full_rows_median_s" in v else ""),
                flush=True,
            )
        del engine
        gc.collect()
        save(ks[: ks.index(k) + 1])


if __name__ == "__main__":
    main()
