"""Attention data parallelism (runtime/parallel/data_parallel.py, runtime/scheduling/dp_scheduler.py).

Device-free part: `DataParallelScheduler` with one `FakeDevice` per rank (tests/test_scheduler.py's
protocol-checking fake, whose own token record is the reference): placement by prefix hits then
outstanding tokens, rank isolation when one rank runs out of pages, D x the tokens per step, and
the flat DP batch against each rank's own `build_batch`.

Device part (ONE subprocess, 8 simulated CPU devices, like tests/test_sharding.py): the engine on
meshes (data 2, model 4) and (data 4, model 2) serves a mixed batch with greedy tokens equal to
the single-device engine (dense Llama by default; the Qwen3.5 hybrid on (data 2, model 4) is
covered by test_sharding.py's engine test, whose mesh now runs DP; hybrid (4, 2) and Qwen3.5-MoE
are `slow`), and a test fills rank 0's pages while rank 1 keeps serving.
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

from runtime.engine_config import CacheConfig, SchedulerConfig
from runtime.parallel.data_parallel import build_data_parallel_batch, rank_share
from runtime.scheduling.dp_scheduler import DataParallelOutput, DataParallelScheduler
from runtime.scheduling.request import Request
from runtime.steps.inputs import build_batch
from runtime.types import SamplingParams
from tests.test_scheduler import FakeDevice, reference_generation

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- device-free: the scheduler ---------------------------------------------------------------------
def make_dp(size=2, page_size=4, num_pages=16, num_state_slots=0, prefix=True, **sched):
    """`size` ranks, each with its own pool of `num_pages` pages (and `num_state_slots` slots)."""
    sched.setdefault("max_model_len", 64)
    cache = CacheConfig(page_size, num_pages, num_state_slots, prefix)
    dp = DataParallelScheduler(SchedulerConfig(**sched), cache, size)
    return dp, [FakeDevice(s.cache) for s in dp.ranks]


def add(dp, devices, request_id, prompt, max_tokens=4):
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))
    dp.add_request(request)
    for device in devices:
        device.add(request)
    return request


def dp_step(dp, devices):
    out = dp.schedule()
    dp.check_invariants()
    sampled = {}
    for rank, (device, rank_out) in enumerate(zip(devices, out.ranks)):
        assert rank_out.num_batched_tokens <= dp.config.max_num_batched_tokens
        assert all(s.request_id not in sampled for s in rank_out.sequences)
        sampled.update(device.step(rank_out))  # asserts every block table / slot is rank-local and right
        device.commit(rank_out, sampled, dp.ranks[rank])
    dp.update_from_output(out, sampled)
    dp.check_invariants()
    return out


def test_random_workload_on_four_ranks_matches_the_reference():
    rng = np.random.default_rng(1)
    dp, devices = make_dp(size=4, num_pages=12, num_state_slots=5, max_num_batched_tokens=8, max_num_seqs=3)
    requests = []
    for i in range(24):
        prompt = rng.integers(1, 50, int(rng.integers(1, 20))).tolist()
        requests.append((add(dp, devices, f"r{i}", prompt, max_tokens=int(rng.integers(1, 8))), prompt))
    for _ in range(400):
        if not dp.has_unfinished():
            break
        dp_step(dp, devices)
    assert not dp.has_unfinished()
    for request, prompt in requests:
        assert request.output_token_ids == reference_generation(prompt, request.params)[0]
    assert sorted(dp.rank_of) == []  # finished requests leave the placement table
    for s in dp.ranks:  # every page and slot back (or cached)
        stats = s.cache.stats()
        assert stats["pages_used"] == 0 and stats["slots_used"] == 0


def test_placement_prefers_prefix_hits_then_fewest_outstanding_tokens():
    dp, devices = make_dp(size=2, num_pages=32, max_num_batched_tokens=32, max_num_seqs=4)
    shared = list(range(1, 13))  # three full pages of 4
    a = add(dp, devices, "a", shared + [40], max_tokens=20)
    assert dp.rank_of["a"] == 0  # tie: lowest rank
    b = add(dp, devices, "b", [7, 8], max_tokens=2)
    assert dp.rank_of["b"] == 1  # rank 1 has nothing outstanding
    dp_step(dp, devices)  # a's prompt is computed: its full pages are in rank 0's prefix cache
    c = add(dp, devices, "c", shared + [41, 42], max_tokens=2)
    assert dp.rank_of["c"] == 0, "the rank holding the prefix wins despite its load"
    d = add(dp, devices, "d", [9] * 5, max_tokens=2)
    assert dp.rank_of["d"] == 1  # no hit anywhere: the rank with fewer outstanding tokens
    while dp.has_unfinished():
        dp_step(dp, devices)
    assert c.num_cached_tokens == 12
    assert [r.output_token_ids for r in (a, b, c, d)] == [
        reference_generation(p, r.params)[0]
        for r, p in ((a, shared + [40]), (b, [7, 8]), (c, shared + [41, 42]), (d, [9] * 5))
    ]


def test_a_rank_out_of_pages_preempts_only_itself_and_the_other_keeps_serving():
    # rank pools of 8 pages of 4 (7 usable = 28 tokens): two long requests on rank 0 cannot both fit
    dp, devices = make_dp(size=2, num_pages=8, prefix=True, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=28)
    prompt = list(range(1, 13))
    long_a = add(dp, devices, "a", prompt + [30], max_tokens=14)  # rank 0
    short = add(dp, devices, "s", [5, 6, 7], max_tokens=20)  # rank 1
    dp_step(dp, devices)
    long_b = add(dp, devices, "b", prompt + [31], max_tokens=14)  # prefix hit: rank 0
    assert dp.rank_of == {"a": 0, "s": 1, "b": 0}
    served = []
    while dp.has_unfinished():
        out = dp_step(dp, devices)
        served.append(any(s.request_id == "s" for s in out.ranks[1].sequences))
    assert dp.ranks[0].num_preemptions > 0 and dp.ranks[1].num_preemptions == 0
    assert all(served[: short.num_output_tokens - 1]), "rank 1 stalled while rank 0 preempted"
    for request, p in ((long_a, prompt + [30]), (long_b, prompt + [31]), (short, [5, 6, 7])):
        assert request.output_token_ids == reference_generation(p, request.params)[0]


def test_a_saturated_step_carries_d_times_the_tokens():
    for size in (1, 2, 4):
        dp, devices = make_dp(size=size, num_pages=64, max_num_batched_tokens=8, max_num_seqs=2)
        for i in range(2 * size):
            add(dp, devices, f"r{i}", list(range(1, 30)), max_tokens=1)
        out = dp_step(dp, devices)
        assert out.num_batched_tokens == 8 * size
        assert dp.stats()["max_tokens_per_step"] == 8 * size


def test_prompt_logprobs_and_reused_ids_are_refused():
    dp, devices = make_dp()
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with attention data parallelism"):
        dp.add_request(Request("p", [1, 2], SamplingParams(max_tokens=1, prompt_logprobs=1)))
    add(dp, devices, "x", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        dp.add_request(Request("x", [3], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="num_pages=3 split over 2 data-parallel ranks leaves 1"):
        rank_share(3, 2, "num_pages")
    assert rank_share(None, 4, "num_pages") is None and rank_share(7, 1, "num_pages") == 7


def test_flat_batch_is_each_ranks_own_batch_side_by_side():
    dp, devices = make_dp(size=3, num_pages=32, max_num_batched_tokens=16, max_num_seqs=4)
    for i, n in enumerate([3, 9, 2, 5, 1]):
        add(dp, devices, f"r{i}", list(range(1, n + 1)))
    out = dp.schedule()
    kwargs = dict(max_num_seqs=4, max_blocks_per_seq=16, page_size=4)
    flat = build_data_parallel_batch(out, token_buckets=(4, 8, 16), **kwargs)
    T = flat.input_ids.shape[0] // 3  # every rank's slice has the same bucket
    assert T in (4, 8, 16) and max(o.num_batched_tokens for o in out.ranks) <= T
    for rank, rank_out in enumerate(out.ranks):
        own = build_batch(rank_out, token_buckets=(T,), **kwargs)
        np.testing.assert_array_equal(flat.input_ids[rank * T : (rank + 1) * T], own.input_ids)
        np.testing.assert_array_equal(flat.slot_mapping[rank * T : (rank + 1) * T], own.slot_mapping)
        np.testing.assert_array_equal(flat.cu_q_lens[rank * 5 : (rank + 1) * 5], own.cu_q_lens)
        np.testing.assert_array_equal(flat.block_tables[rank * 4 : (rank + 1) * 4], own.block_tables)
        assert flat.num_seqs[rank] == len(rank_out.sequences)
    # logits rows follow the combined sequence order: sequence i's last token in the flat token axis
    for i, seq in enumerate(out.sequences):
        row = flat.logits_indices[i]
        assert (
            flat.input_ids[row] == seq.token_ids[-1]
            and flat.positions[row] == seq.start_position + len(seq.token_ids) - 1
        )
    assert isinstance(out, DataParallelOutput)


# ---- 8 simulated devices: the engine -------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    paths, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    report, t0 = {}, time.perf_counter()

    def engine_for(name, mesh_shape, **kw):
        kw = {"page_size": 16, "num_pages": 32, "max_num_seqs": 4, "max_num_batched_tokens": 32,
              "token_buckets": (4, 16, 32), "max_model_len": 96, "enable_prefix_caching": False,
              "aot_compile": False, **kw}  # compile what runs (a meshed start-up set: test_sharding)
        return LLMEngine(EngineConfig(model=paths[name], load_tokenizer=False, mesh_shape=mesh_shape, **kw))

    def mixed(name, mesh_shape, prefix=False):
        # prefills + decodes of different lengths; with `prefix`, prompts share 32- and 48-token
        # prefixes (hybrids: state checkpoints copied into and out of slots on every rank)
        engine = engine_for(name, mesh_shape, enable_prefix_caching=prefix)
        done = {}
        rng = np.random.default_rng(0)
        shared = rng.integers(3, 1000, 48).tolist()
        for i, n in enumerate([5, 40, 9, 23, 2, 17, 31]):
            prompt = rng.integers(3, 1000, n).tolist()
            if prefix and i % 2:
                prompt = shared[: 32 + 16 * (i % 4 == 3)] + prompt[:8]
            engine.add_request(EngineRequest(f"r{i}", prompt,
                                             SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)))
            if prefix and i == 1:  # r1's pages (and checkpoints) are cached before the others arrive
                for _ in range(3):
                    for out in engine.step():
                        done.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)  # deltas add up
        stats = engine.stats()
        return {"tokens": done, "max_tokens_per_step": stats.get("max_tokens_per_step"),
                "hit_tokens": stats["prefix_cache_hit_tokens"], "checkpoints": stats["checkpoints_written"],
                "pages_used": stats["pages_used"], "slots_used": stats["slots_used"]}

    def isolation(name):
        # D=2, 6 pages per rank (5 usable x 16 = 80 tokens); two 70-token requests on rank 0
        engine = engine_for(name, (2, 4), num_pages=12, enable_prefix_caching=True, max_model_len=80)
        greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 51))  # 48 tokens: 3 full pages
        engine.add_request(EngineRequest("a", prompt + [60], greedy(22)))
        engine.add_request(EngineRequest("s", [7, 8, 9], greedy(40)))
        done, served, steps = {}, [], 0
        for out in engine.step() + engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.add_request(EngineRequest("b", prompt + [61], greedy(22)))
        ranks = dict(engine.scheduler.rank_of)
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            served.append(any(o.request_id == "s" for o in outs))
            for out in outs:
                done.setdefault(out.request_id, []).extend(out.new_token_ids)  # deltas add up
        ref = engine_for(name, None, num_pages=40, max_model_len=80)
        for rid, p in (("a", prompt + [60]), ("b", prompt + [61]), ("s", [7, 8, 9])):
            ref.add_request(EngineRequest(rid, p, greedy(40 if rid == "s" else 22)))
        ref_done = {}
        while ref.has_unfinished():
            for out in ref.step():
                ref_done.setdefault(out.request_id, []).extend(out.new_token_ids)  # deltas add up
        return {"ranks": ranks, "preemptions": [s.num_preemptions for s in engine.scheduler.ranks],
                "served": served, "tokens": done, "reference": ref_done}

    for case in cases:
        if case == "isolation":
            report[case] = isolation("dense")
        else:
            name, data, model, *prefix = case.split(":")
            report[case] = mixed(name, None if data == "1" else (int(data), int(model)), bool(prefix))
        print(f"{case} done {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print("REPORT " + json.dumps(report))
""")


def _checkpoints(root: Path, names) -> dict[str, str]:
    from models.random_checkpoint import write_random_checkpoint

    specs = {  # head counts that divide by the model axis (2 and 4), so TP and DP both run
        "dense": ("llama", dict(num_attention_heads=8, num_key_value_heads=4)),
        "hybrid": (
            "qwen3_5",
            dict(num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8),
        ),
        "moe": (
            "qwen3_5_moe",
            dict(num_attention_heads=4, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8),
        ),
    }
    return {n: str(write_random_checkpoint(specs[n][0], root / n, vocab_size=1032, **specs[n][1])) for n in names}


def _run(tmp_path_factory, names, cases) -> dict:
    paths = _checkpoints(tmp_path_factory.mktemp("dp_checkpoints"), names)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(paths), json.dumps(cases)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    sys.stderr.write(proc.stderr[-1000:])
    return json.loads(line[len("REPORT ") :])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return _run(tmp_path_factory, ["dense"], ["dense:1:1", "dense:2:4", "dense:4:2", "isolation"])


def _check_mixed(single, sharded, data):
    assert len(single["tokens"]) == 7 and all(len(t) == 3 + int(r[1:]) for r, t in single["tokens"].items())
    assert sharded["tokens"] == single["tokens"]
    assert sharded["pages_used"] == 0 and sharded["slots_used"] == 0  # every rank's pages back
    # tokens per step scale with D: one rank's step is capped at 32 tokens, D ranks' at D x 32
    assert 32 < sharded["max_tokens_per_step"] <= 32 * data


@pytest.mark.parametrize("data, model", [(2, 4), (4, 2)])
def test_dense_data_parallel_engine_matches_single_device(report, data, model):
    _check_mixed(report["dense:1:1"], report[f"dense:{data}:{model}"], data)


def test_filling_rank_zero_leaves_rank_one_serving(report):
    case = report["isolation"]
    assert case["ranks"] == {"a": 0, "s": 1, "b": 0}  # b follows its prefix to rank 0
    assert case["preemptions"][0] > 0 and case["preemptions"][1] == 0
    assert all(case["served"][: len(case["tokens"]["s"]) - 2]), "rank 1's request skipped a step"
    assert case["tokens"] == case["reference"]


@pytest.mark.slow
def test_hybrid_and_moe_data_parallel_engines_match_single_device(tmp_path_factory):
    cases = ["hybrid:1:1", "hybrid:4:2", "hybrid:1:1:prefix", "hybrid:2:4:prefix", "moe:1:1", "moe:2:4", "moe:4:2"]
    report = _run(tmp_path_factory, ["hybrid", "moe"], cases)
    _check_mixed(report["hybrid:1:1"], report["hybrid:4:2"], 4)
    single, sharded = report["hybrid:1:1:prefix"], report["hybrid:2:4:prefix"]
    assert sharded["tokens"] == single["tokens"] and sharded["hit_tokens"] > 0 and sharded["checkpoints"] > 0
    _check_mixed(report["moe:1:1"], report["moe:2:4"], 2)
    _check_mixed(report["moe:1:1"], report["moe:4:2"], 4)
