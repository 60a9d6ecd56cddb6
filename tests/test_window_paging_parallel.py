"""Window-aware paging under attention data parallelism and P/D disaggregation (issue 34).

DP: every rank holds its own pair of pools (full layers' pages and the window layers' pages); its
window block tables travel in the flat DP batch. Device-free: the flat batch carries each rank's
window tables and slots as that rank's own `build_batch` does, null tables for a rank that schedules
nothing. Device part (ONE subprocess, 4 simulated CPU devices, like tests/test_data_parallel.py; slow):
tiny gpt-oss on meshes (data 2, model 2) and (data 4, model 1) with window paging on serves a mixed
batch (prompts several windows long, chunked prefill, preemption on a small pool, prefix hits) with
greedy tokens equal to the one-device engine with window paging off (the feature under test not
involved), and every rank's two pools are empty at the end.

P/D (runtime/kv_transfer/window_layout.py; in process, through test_kv_transfer's plugin connector):
the prefill side ships the window layers' live blocks only and every full-layer block; a decode
side admits a pulled request with window pages for its live window only. Greedy tokens equal a
colocated engine with window paging off, pages of 4 both sides (verbatim copy) and 4 -> 8 (token by
token); a prefill side without window paging feeds a decode side with it; a decode side without
it refuses a windowed transfer and prefills locally (exact, counted); every pool empty at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from paged_kv import NULL_PAGE, CacheManager
from runtime.engine_config import CacheConfig, SchedulerConfig
from runtime.parallel.data_parallel import build_data_parallel_batch
from runtime.scheduling.dp_scheduler import DataParallelScheduler
from runtime.scheduling.request import Request
from runtime.steps.inputs import build_batch
from runtime.types import EngineRequest, SamplingParams
from tests.engine_testing import drain, small_engine_config
from tests.test_kv_transfer import plugin  # noqa: F401  (the in-process connector fixture)

REPO_ROOT = Path(__file__).resolve().parents[1]
W, PS = 7, 4  # the tiny gpt-oss window; pages of 4 tokens


# ---- device-free: the flat batch ------------------------------------------------------------------------
def test_flat_batch_carries_each_ranks_window_tables_and_null_ones_for_an_idle_rank():
    cache = CacheConfig(PS, 40, 0, True, window=W, num_window_pages=16)
    dp = DataParallelScheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4), cache, 3)
    for i, n in enumerate([30, 9]):  # two requests: rank 2 stays idle
        dp.add_request(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4)))
    kwargs = dict(max_num_seqs=4, max_blocks_per_seq=16, page_size=PS)
    for _ in range(3):  # r0's prompt is chunked: by the third step its first blocks slid out of the window
        out = dp.schedule()
        flat = build_data_parallel_batch(out, token_buckets=(4, 8, 16), **kwargs)
        T = flat.input_ids.shape[0] // 3
        for rank, rank_out in enumerate(out.ranks):
            rows, toks = slice(rank * 4, (rank + 1) * 4), slice(rank * T, (rank + 1) * T)
            if not rank_out.sequences:
                assert (flat.window_block_tables[rows] == 0).all() and (flat.window_slot_mapping[toks] == -1).all()
                continue
            own = build_batch(rank_out, token_buckets=(T,), **kwargs)
            np.testing.assert_array_equal(flat.window_block_tables[rows], own.window_block_tables)
            np.testing.assert_array_equal(flat.window_slot_mapping[toks], own.window_slot_mapping)
            np.testing.assert_array_equal(flat.block_tables[rows], own.block_tables)
        dp.update_from_output(out, {s.request_id: [5] for s in out.sequences if s.sample})
        dp.check_invariants()
    assert len([o for o in out.ranks if o.sequences]) == 2
    r0 = dp.ranks[dp.rank_of["r0"]].requests["r0"].allocation
    assert r0.window_low > 0 and r0.window_block_table[0] == 0  # released blocks are the null page


# ---- 4 simulated devices: the engine -------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    path, cases = sys.argv[1], json.loads(sys.argv[2])
    report = {}

    def run(mesh_shape, window_paging):
        # pages of 4, 8-token steps (chunked prefill), 30 pages per rank: the requests placed on a rank
        # need more than that beside their shared prefix (preemption); prefix caching on
        engine = LLMEngine(EngineConfig(
            model=path, load_tokenizer=False, mesh_shape=mesh_shape, page_size=4, num_pages=30 * (mesh_shape or (1,))[0],
            max_num_seqs=4, max_num_batched_tokens=8, token_buckets=(4, 8), max_model_len=96,
            enable_prefix_caching=True, window_paging=window_paging, aot_compile=False))
        rng = np.random.default_rng(0)
        shared = rng.integers(3, 200, 29).tolist()
        prompts = {f"r{i}": shared + rng.integers(3, 200, n).tolist() for i, n in enumerate((1, 31, 17, 40, 5, 23))}
        prompts["alone"] = rng.integers(3, 200, 50).tolist()
        done, window_used = {}, []
        for rid, ids in prompts.items():
            engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
            window_used.append(engine.stats().get("window_pages_used", 0))
        for rid in ("r1", "r3"):  # again, alone: a prefix hit across several windows
            engine.add_request(EngineRequest(rid + "-again", prompts[rid],
                                             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
            while engine.has_unfinished():
                for out in engine.step():
                    done.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_invariants()
        stats = engine.stats()
        cache = engine.scheduler.ranks[0].cache if mesh_shape else engine.scheduler.cache
        return {"tokens": done, "pages_used": stats["pages_used"], "window_pages_used": stats.get("window_pages_used"),
                "max_window_pages_used": max(window_used), "window": cache.window is not None,
                "preemptions": stats["num_preemptions"], "hit_tokens": stats["prefix_cache_hit_tokens"],
                "ranks": sorted(set(getattr(engine.scheduler, "rank_of", {}).values()))}

    for case in cases:
        data, model, paging = case.split(":")
        report[case] = run(None if data == "1" else (int(data), int(model)), paging == "on")
        print(case, "done", file=sys.stderr)
    print("REPORT " + json.dumps(report))
""")


@pytest.fixture(scope="module")
def report(tiny_checkpoint):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    cases = ["1:1:off", "2:2:on", "4:1:on"]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint("gpt_oss")), json.dumps(cases)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return json.loads(line[len("REPORT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2:2", "4:1"])
def test_window_paged_data_parallel_engine_matches_the_one_device_engine_without_it(report, mesh):
    single, dp = report["1:1:off"], report[f"{mesh}:on"]
    assert not single["window"] and dp["window"]
    assert len(single["tokens"]) == 9 and all(len(t) == 12 for t in single["tokens"].values())
    assert dp["tokens"] == single["tokens"]
    assert dp["pages_used"] == 0 and dp["window_pages_used"] == 0  # every rank's two pools back
    assert dp["max_window_pages_used"] > 0 and len(dp["ranks"]) > 1
    assert dp["hit_tokens"] > 0


# ---- P/D: admission of pulled tokens --------------------------------------------------------------------
def test_pulled_tokens_get_window_pages_for_their_live_window_only():
    cache = CacheManager(page_size=PS, num_pages=40, enable_prefix_caching=True, window=W, num_window_pages=6)
    tokens = list(range(1, 42))  # 40 pulled tokens + the last prompt token, computed here
    admission = cache.allocate("r", tokens, 41, num_external=40)
    allocation = admission.allocation
    first_live = (40 - W + 1) // PS  # the lowest block a query at position >= 40 sees
    assert allocation.window_low == first_live == 8
    assert allocation.window_block_table[:first_live] == [NULL_PAGE] * first_live
    assert all(p != NULL_PAGE for p in allocation.window_block_table[first_live:])
    assert len(allocation.block_table) == len(allocation.window_block_table) == 11  # full layers: every block
    assert cache.window.stats()["window_pages_used"] == 11 - first_live  # 3 of a 5-page pool
    cache.window.check_invariants(cache.allocations.values())
    # without num_external the same admission needs 11 window pages: more than the pool holds
    assert cache.allocate("s", tokens, 41) is None


# ---- P/D: two engines in process ------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _pd_config(path, **overrides):
    base = dict(page_size=PS, num_pages=64, max_num_batched_tokens=16, max_model_len=128)
    return small_engine_config(path, **{**base, **overrides})


def _run(engine, prompt, params=None, rid="r"):
    engine.add_request(EngineRequest(rid, prompt, GREEDY, kv_transfer_params=params))
    return drain(engine)[rid]


def _all_free(engine):
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats.get("window_pages_used", 0) == 0, stats
    assert stats.get("kv_transfer_requests_pulling", 0) == 0


@pytest.fixture(scope="module")
def pd_engines(plugin, tiny_checkpoint):  # noqa: F811
    from runtime.engine.llm_engine import LLMEngine
    from runtime.kv_transfer import KVTransferConfig

    path = tiny_checkpoint("gpt_oss")
    role = lambda r: KVTransferConfig(role=r, connector=plugin)
    built = {
        "prefill": LLMEngine(_pd_config(path, kv_transfer=role("prefill"))),
        "prefill_full": LLMEngine(_pd_config(path, kv_transfer=role("prefill"), window_paging=False)),
        "decode": LLMEngine(_pd_config(path, kv_transfer=role("decode"))),
        "decode_8": LLMEngine(_pd_config(path, page_size=8, kv_transfer=role("decode"))),
        "decode_full": LLMEngine(_pd_config(path, kv_transfer=role("decode"), window_paging=False)),
        "colocated": LLMEngine(_pd_config(path, window_paging=False)),
    }
    return built


PD_PROMPT_LENGTHS = (1, 6, 9, 23, 41, 70)  # the window is 7: up to ten windows long


def _pd_prompts(vocab):
    rng = np.random.default_rng(34)
    return [rng.integers(3, vocab, n).tolist() for n in PD_PROMPT_LENGTHS]


@pytest.mark.parametrize("decode", ["decode", pytest.param("decode_8", marks=pytest.mark.slow)])
def test_prefill_ships_the_live_window_and_decode_equals_colocated(pd_engines, decode):
    prefill, dec, colocated = pd_engines["prefill"], pd_engines[decode], pd_engines["colocated"]
    assert prefill.scheduler.cache.window is not None and dec.scheduler.cache.window is not None
    for i, prompt in enumerate(_pd_prompts(prefill.model.cfg.vocab_size)):
        want = _run(colocated, prompt).outputs[0].token_ids
        params = _run(prefill, prompt, {"do_remote_decode": True}).kv_transfer_params
        if len(prompt) == 1:
            assert params is None
            continue
        desc = params["descriptor"]
        K = len(prompt) - 1
        first = max(0, K - W + 1) // PS
        assert desc["window"]["first_block"] == first
        shapes, G = {name: shape for name, shape, _ in desc["arrays"]}, desc["model"]["num_groups"]
        assert shapes["kv0.k"][0] == G * desc["window"]["num_pages"]  # position 0 slides: its live blocks only
        assert shapes["kv1.k"][0] == G * desc["num_pages"]  # position 1 is full attention: every block
        got = _run(dec, prompt, params).outputs[0].token_ids
        assert got == want, f"prompt {i} (len {len(prompt)})"
    assert dec.stats()["kv_transfer_fallbacks"] == 0
    for engine in (prefill, dec):
        _all_free(engine)


@pytest.mark.slow
def test_mixed_window_paging_sides_stay_exact(pd_engines):
    prompt = _pd_prompts(pd_engines["colocated"].model.cfg.vocab_size)[4]  # 41 tokens
    want = _run(pd_engines["colocated"], prompt).outputs[0].token_ids
    # a prefill side without window paging ships every block: a window-paged decode side drops the dead ones
    params = _run(pd_engines["prefill_full"], prompt, {"do_remote_decode": True}).kv_transfer_params
    assert "window" not in params["descriptor"]
    decode = pd_engines["decode"]
    fallbacks = decode.stats()["kv_transfer_fallbacks"]
    assert _run(decode, prompt, params).outputs[0].token_ids == want
    assert decode.stats()["kv_transfer_fallbacks"] == fallbacks
    # a decode side without it needs the dead blocks too: the transfer is refused, the prompt prefilled here
    params = _run(pd_engines["prefill"], prompt, {"do_remote_decode": True}).kv_transfer_params
    full = pd_engines["decode_full"]
    assert _run(full, prompt, params).outputs[0].token_ids == want
    assert full.stats()["kv_transfer_fallbacks"] == 1
    for name in ("prefill", "prefill_full", "decode", "decode_full"):
        _all_free(pd_engines[name])


def test_plan_under_data_parallelism_sizes_both_pools_per_rank():
    """`jaxserve plan` (sizing only) for Gemma-3-27B on 4 TPU v5p chips as 2 DP ranks x model 2: each
    rank's device holds its full layers' pages and its own window pool, sized like the engine's."""
    from configs.schema import CONFIG_DIR, LaunchConfig
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.aot.chip_report import plan_config

    cfg = parse_config(read_json(CONFIG_DIR / "models" / "gemma-3-27b.json"))
    windowed = sum(cfg.sliding_window(i) is not None for i in range(cfg.num_layers))
    heads, page, seqs, step_tokens = cfg.num_kv_heads // 2, 128, 64, 2048
    page_bytes = lambda layers: 2 * layers * heads * cfg.head_dim * 2 * page

    launch = LaunchConfig.model_validate(
        {
            "model": {"path": "/models/gemma-3-27b-it", "dtype": "bfloat16", "max_model_len": 32768},
            "cache": {"page_size": page, "memory_fraction": 0.85},
            "scheduler": {"max_num_seqs": seqs, "max_num_batched_tokens": step_tokens},
            "parallel": {"mesh": {"data": 2, "model": 2}, "chip": "tpu-v5p", "topology": "2x2x1"},
        }
    )
    report = plan_config(launch, token_buckets=(), compile_sampler=False, compile_cost=False)
    assert report.window == 1024 and report.num_window_pages == seqs * (1024 // page + 2) + step_tokens // page + 1
    assert report.kv_bytes == report.num_pages * page_bytes(cfg.num_layers - windowed) + (
        report.num_window_pages * page_bytes(windowed)
    )
    assert report.fits


def test_window_descriptor_entries_are_checked(tiny_checkpoint):
    from models.config import parse_config
    from models.safetensors_io import read_json
    from runtime.kv_transfer.base import TransferError
    from runtime.kv_transfer.window_layout import check_window

    cfg = parse_config(read_json(tiny_checkpoint("gpt_oss") / "config.json"))  # window 7
    desc = {"num_tokens": 40, "page_size": PS, "num_pages": 16}  # 10 blocks; queries at >= 40 see keys >= 34
    check_window({**desc, "window": {"first_block": 8, "num_pages": 2}}, cfg, paged=True)
    check_window(desc, cfg, paged=False)  # no window entry: every block was sent
    bad = {
        "not an object": 3,
        "unknown field": {"first_block": 8, "num_pages": 2, "x": 1},
        "a bool": {"first_block": True, "num_pages": 2},
        "page count": {"first_block": 8, "num_pages": 4},
        "past the end": {"first_block": 10, "num_pages": 1},
        "a live key missing": {"first_block": 9, "num_pages": 1},
    }
    for window in bad.values():
        with pytest.raises(TransferError):
            check_window({**desc, "window": window}, cfg, paged=True)
    with pytest.raises(TransferError, match="full-length KV"):  # this side needs every block
        check_window({**desc, "window": {"first_block": 8, "num_pages": 2}}, cfg, paged=False)
    check_window({**desc, "window": {"first_block": 0, "num_pages": 16}}, cfg, paged=False)  # all sent: usable
