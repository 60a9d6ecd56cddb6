"""The prefix-cache simulator and the checkpoint policies, device-free.

Hit counts are checked against a brute-force longest-common-prefix over the trace, computed
here without the cache manager: with requests served one at a time and unbounded memory, a
request can reuse the longest page-aligned prefix it shares with any earlier request's
computed tokens (prompt + output, less the last output token, which is never fed), leaving at
least one prompt token to compute. The policies also run on the scheduler tests' FakeDevice,
which checks every restored state against its own record of each request's tokens.
"""

import random
from pathlib import Path

import pytest
from import_testing import imports_jax
from test_scheduler import VOCAB, FakeDevice, add, reference_generation, step

from benchmarks.model_shapes import load_shape, plan_memory
from benchmarks.prefix_cache_sim import SimConfig, ceiling, run_trace, simulate
from benchmarks.prefix_traces import Session, Turn, make_trace
from paged_kv import CacheManager
from runtime.engine_config import SchedulerConfig
from runtime.scheduling.scheduler import Scheduler

PS = 16
MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def serial(sessions):
    """One request at a time: sessions far apart in time, each finishing before the next."""
    return [
        Session(s.session_id, s.turns, start_step=i * 100_000, think_steps=s.think_steps)
        for i, s in enumerate(sessions)
    ]


def brute_force_hit_tokens(sessions, page_size=PS):
    computed, total = [], 0
    for session in sessions:
        for k, turn in enumerate(session.turns):
            prompt = session.prompt(k)
            best = 0
            for earlier in computed:
                n = 0
                while n < min(len(prompt) - 1, len(earlier)) and prompt[n] == earlier[n]:
                    n += 1
                best = max(best, n // page_size * page_size)
            total += best
            computed.append(prompt + list(turn.output[:-1]))
    return total


def small_trace():
    chat = make_trace("chat", vocab_size=5000, seed=3, num_sessions=3)
    shots = make_trace("few_shot", vocab_size=5000, seed=3, num_sessions=4)
    return serial(chat + shots)


def unbounded_hybrid(policy, sessions):
    pages = sum(len(s.prompt(len(s.turns) - 1)) + len(s.turns[-1].output) for s in sessions) // PS + 10
    cache = CacheManager(page_size=PS, num_pages=pages, num_state_slots=4000, checkpoint_policy=policy)
    return run_trace(sessions, cache, SimConfig(max_num_seqs=1, max_num_batched_tokens=512))["stats"]


def test_hit_counts_match_a_brute_force_longest_common_prefix():
    sessions = small_trace()
    expected = brute_force_hit_tokens(sessions)
    assert expected == 39504  # pinned: the trace generator and the brute force are both deterministic
    top = ceiling(sessions, SimConfig(max_num_seqs=1, max_num_batched_tokens=512))
    assert top["hit_tokens"] == expected
    assert unbounded_hybrid("every_page", sessions)["prefix_cache_hit_tokens"] == expected
    auto = unbounded_hybrid("auto", sessions)["prefix_cache_hit_tokens"]
    assert 0.9 * expected <= auto <= expected


def test_block_aligned_checkpoints_never_hit_chat_prompts_shorter_than_the_block():
    turns = lambda i: (
        Turn(tuple(range(1, 301)) + (1000 + i,), tuple(range(2000, 2100))),
        Turn((7, 8, 9), (5, 6)),
    )
    sessions = serial([Session(f"s{i}", turns(i)) for i in range(4)])  # prompts of 301 and 404 tokens
    align = unbounded_hybrid("align:528", sessions)
    assert align["prefix_cache_hit_tokens"] == 0
    auto = unbounded_hybrid("auto", sessions)
    # Every second turn resumes after the first's output (the rolling request-end checkpoint at
    # 400 of 400 computed tokens). The first prompt's end checkpoint (288) was superseded by its
    # request-end one, so the second session finds KV but no state at 288 and saves a
    # divergence checkpoint there; the third and fourth resume the shared prefix at 288.
    assert auto["prefix_cache_hit_tokens"] == 4 * 400 + 2 * 288 == brute_force_hit_tokens(sessions) - 288


def test_simulation_is_deterministic_and_reports_memory_by_use():
    shape = load_shape(MODELS / "qwen3_5-9b.json")
    plan = plan_memory(shape, max_num_seqs=8, budget_fraction=0.1)
    assert (
        plan.num_checkpoint_slots == int(0.1 * plan.cache_bytes // shape.state_bytes_per_slot) < 8 * 32
    )  # memory binds
    assert plan_memory(shape, max_num_seqs=256, budget_fraction=0.05).num_checkpoint_slots == int(
        0.05 * plan.cache_bytes // shape.state_bytes_per_slot
    )  # the fraction binds
    sessions = make_trace("chat", vocab_size=shape.vocab_size, seed=1, num_sessions=6, spread_steps=50)
    config = SimConfig(max_num_seqs=8, max_num_batched_tokens=1024)
    first, second = simulate(sessions, plan, "auto", config), simulate(sessions, plan, "auto", config)
    assert first == second
    assert set(first["avg_gib"]) == {"kv_running", "kv_cached", "slots_running", "checkpoints"}
    assert first["peak_gib"]["checkpoints"] <= round(plan.num_checkpoint_slots * shape.state_bytes_per_slot / 2**30, 2)
    assert 0 < first["hit_rate"] <= ceiling(sessions, config)["hit_rate"]


def test_model_shapes_from_config_json():
    nine = load_shape(MODELS / "qwen3_5-9b.json")
    # 8 attention layers x (K, V) x 4 KV heads x 256 x bf16; 24 GDN layers x fp32 (conv 3 x 8192 + 32 x 128 x 128)
    assert nine.kv_bytes_per_token("bfloat16") == 8 * 2 * 4 * 256 * 2
    assert nine.state_bytes_per_slot == 24 * 4 * (3 * 8192 + 32 * 128 * 128)
    assert 8.9e9 < nine.num_params < 9.0e9  # text model of Qwen3.5-9B (no vision tower, no MTP)
    next80 = load_shape(MODELS / "qwen3-next-80b-a3b.json")
    assert next80.num_linear_layers == 36 and 79e9 < next80.num_params < 80.5e9
    assert next80.state_bytes_per_slot / 2**20 == pytest.approx(75.4, abs=0.1)


@pytest.mark.parametrize("policy", ["auto", "auto,interval=8,per_path_cap=2", "align:8", "every_page"])
@pytest.mark.parametrize("seed", range(2))
def test_policies_restore_exact_states_under_a_random_workload(policy, seed):
    rng = random.Random(seed)
    cache = CacheManager(page_size=4, num_pages=12, num_state_slots=7, checkpoint_policy=policy, num_checkpoint_slots=3)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=3, max_model_len=40), cache)
    device = FakeDevice(cache)
    prefixes = [[rng.randrange(1, VOCAB + 1) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    requests, restores = [], 0
    for _ in range(3000):
        if len(requests) < 40 and rng.random() < 0.5:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 20)] + [rng.randrange(1, VOCAB + 1)]
            requests.append(add(scheduler, device, f"r{len(requests)}", prompt, max_tokens=rng.randrange(1, 12)))
        out, _ = step(scheduler, device)
        restores += len(out.copy_before)
        if len(requests) == 40 and not scheduler.has_unfinished():
            break
    else:
        pytest.fail("workload did not drain")
    stats = scheduler.stats()
    assert stats["slots_used"] == 0 and stats["slots_cached"] <= 3 and restores > 0
    for request in requests:
        assert request.output_token_ids == reference_generation(request.prompt_token_ids, request.params)[0]


def test_simulator_imports_no_jax():
    assert not imports_jax("benchmarks.prefix_cache_sim")
