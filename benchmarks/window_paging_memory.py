"""Window-aware paging's memory (issue 34): a 32k-token gpt-oss-120b context, with and without it.

1. The engine's own accounting: gpt-oss-120b's shapes (configs/models/gpt-oss-120b.json, no
   weights), the engine's `EngineConfig.cache_config` pools and page bytes
   (runtime/engine/construction.py `page_bytes`), and its `Scheduler` + `CacheManager` running one
   request through a 32,000-token prompt in chunks and 768 decode steps (a device-free step: the
   scheduler never looks at the tokens). KV bytes = full-layer pages in use x their bytes + window
   pages in use x theirs (without window paging: pages in use x every layer's bytes), peak and at
   the end (32,768 tokens in context).
2. `jaxserve plan`'s pools for gpt-oss-120b on TPU v5p (4 chips, model axis 4), max_model_len 32k,
   both ways: `runtime.aot.chip_report.plan_config` sizes them as the engine does, and
   `PlanReport.max_sequences(32768)` is how many 32k-token sequences they hold at once; the same
   for Gemma-3-27B (configs/models/gemma-3-27b.json).

    python benchmarks/window_paging_memory.py [--compile [--buckets 16,4096]]   # also compile the backbones

Writes benchmarks/results/window-paging/gpt-oss-120b-32k.json (-compiled.json with --compile: the
token buckets' backbones of both models compiled for v5p by libtpu, per-device temp and peak of each).
The earlier compiled run's 133 GB of temporaries was the lane-padded copy of the head_dim-64 KV pool,
gone since pages are stored token-minor on TPU (runtime/aot/chip_report.py `kv_page_layout`), not the
MoE step: benchmarks/gpt_oss_moe_temp.py measures that.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from configs.schema import CONFIG_DIR, LaunchConfig
from models.abstract import abstract_model
from models.config import parse_config
from models.safetensors_io import read_json
from paged_kv.window_pages import window_pool_pages
from runtime.engine.construction import page_bytes
from runtime.engine_config import EngineConfig
from runtime.scheduling.request import Request
from runtime.scheduling.scheduler import Scheduler
from runtime.types import SamplingParams

RESULTS = Path(__file__).parent / "results" / "window-paging"
MODEL_JSON = CONFIG_DIR / "models" / "gpt-oss-120b.json"
PROMPT, DECODE, CONTEXT = 32_000, 768, 32_768
PAGE_SIZE, CHUNK, SEQS = 16, 512, 8


def engine_accounting(window_paging: bool) -> dict:
    """One request through the engine's scheduler and pools; KV bytes in use, peak and final."""
    cfg = parse_config(read_json(MODEL_JSON))
    model = abstract_model(cfg, "bfloat16", str(MODEL_JSON.parent))
    blocks = -(-CONTEXT // PAGE_SIZE)
    config = EngineConfig(
        model=str(MODEL_JSON),
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        max_num_seqs=SEQS,
        max_num_batched_tokens=CHUNK,
        max_model_len=CONTEXT,
        window_paging=window_paging,
    )
    window = max(w for i in range(cfg.num_layers) if (w := cfg.sliding_window(i)) is not None)
    num_pages = SEQS * blocks + 1
    if window_paging:
        num_window_pages = window_pool_pages(window, PAGE_SIZE, SEQS, CHUNK)
        cache_config = config.cache_config(num_pages, CONTEXT, window=(window, num_window_pages))
        full_page, window_page = page_bytes(config, model, "full"), page_bytes(config, model, "window")
    else:
        num_window_pages = 0
        cache_config = config.cache_config(num_pages, CONTEXT)
        full_page, window_page = page_bytes(config, model, "all"), 0
    scheduler = Scheduler(config.scheduler_config(CONTEXT), cache_config.build_manager())
    params = SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("ctx", [7] * PROMPT, params))
    peak, steps = 0, 0
    final = {}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        stats = scheduler.stats()
        used = stats["pages_used"] * full_page + stats.get("window_pages_used", 0) * window_page
        peak = max(peak, used)
        final = {
            "pages_used": stats["pages_used"],
            "window_pages_used": stats.get("window_pages_used", 0),
            "kv_bytes": used,
        }
        scheduler.update_from_output(out, {s.request_id: [7] for s in out.sequences if s.sample})
        steps += 1
    scheduler.check_invariants()
    return {
        "window_paging": window_paging,
        "window": window if window_paging else None,
        "page_size": PAGE_SIZE,
        "num_pages": num_pages,
        "num_window_pages": num_window_pages,
        "page_bytes_full_pool": full_page,
        "page_bytes_window_pool": window_page,
        "steps": steps,
        "peak_kv_bytes": peak,
        "last_step": final,
        "context_tokens": CONTEXT - 1,  # the last sampled token is never fed
    }


def plan(window_paging: bool, buckets: tuple[int, ...] | None, model_dir: Path | str) -> dict:
    """`buckets`: the token buckets to compile (None: every one; (): sizing only)."""
    from runtime.aot.chip_report import plan_config

    launch = LaunchConfig.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "bfloat16", "max_model_len": CONTEXT},
            "cache": {"page_size": 128, "memory_fraction": 0.85, "window_paging": window_paging},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 4096},
            "parallel": {"mesh": {"data": 1, "model": 4}, "chip": "tpu-v5p", "topology": "2x2x1"},
        }
    )
    t0 = time.perf_counter()
    report = plan_config(
        launch,
        f"{Path(model_dir).name} v5p-4 window_paging={window_paging}",
        token_buckets=buckets,
        compile_sampler=False,
        compile_cost=False,
    )
    return {
        "window_paging": window_paging,
        "chip": report.chip.name,
        "devices": report.num_devices,
        "page_size": report.page_size,
        "memory_fraction": report.memory_fraction,
        "weight_bytes_per_device": report.weight_bytes,
        "kv_bytes_per_device": report.kv_bytes,
        "num_pages": report.num_pages,
        "num_window_pages": report.num_window_pages,
        "window": report.window,
        "max_sequences_at_32k": report.max_sequences(CONTEXT),
        "executables": [{"name": s.name, "temp_bytes": s.temp_bytes, "peak_bytes": s.peak_bytes} for s in report.steps],
        "fits": report.fits,
        "problems": report.problems,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also compile the backbones for the chip")
    parser.add_argument("--buckets", default=None, help="with --compile: these token buckets (16,4096); default all")
    args = parser.parse_args()
    buckets = () if not args.compile else None if args.buckets is None else tuple(map(int, args.buckets.split(",")))
    engine = {str(on): engine_accounting(on) for on in (False, True)}
    without, with_ = engine["False"]["last_step"]["kv_bytes"], engine["True"]["last_step"]["kv_bytes"]
    with tempfile.TemporaryDirectory() as tmp:  # plan reads <model.path>/config.json: the shipped copy
        model_dir = Path(tmp) / "gpt-oss-120b"
        model_dir.mkdir()
        shutil.copy(MODEL_JSON, model_dir / "config.json")
        plans = {str(on): plan(on, buckets, model_dir) for on in (False, True)}
    # the same launch for Gemma-3-27B (5 local layers of window 1024 per global one; shipped config)
    gemma = {str(on): plan(on, buckets, "/models/gemma-3-27b-it") for on in (False, True)}
    result = {
        "model": "gpt-oss-120b (configs/models/gpt-oss-120b.json: 36 layers, 18 with window 128, 8 KV heads x 64)",
        "engine_accounting": engine,
        "kv_bytes_32k_without": without,
        "kv_bytes_32k_with": with_,
        "kv_ratio_with_over_without": with_ / without,
        "plan": plans,
        "max_sequences_at_32k_without": plans["False"]["max_sequences_at_32k"],
        "max_sequences_at_32k_with": plans["True"]["max_sequences_at_32k"],
        "gemma_3_27b_plan": gemma,
        "gemma_3_27b_max_sequences_at_32k_without": gemma["False"]["max_sequences_at_32k"],
        "gemma_3_27b_max_sequences_at_32k_with": gemma["True"]["max_sequences_at_32k"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"gpt-oss-120b-32k{'-compiled' if args.compile else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("engine_accounting", "plan", "gemma_3_27b_plan")}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
