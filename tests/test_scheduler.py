"""Device-free scheduler tests, run against a fake device that checks the protocol end to end.

`FakeDevice` executes a SchedulerOutput the way the runtime must: it writes the fed token ids
into a paged "KV cache" through the block tables, reads each sequence's whole context back
through its block table, keeps per-slot "state" (the tokens a slot has consumed) with the
copy_before / copy_after / has_initial_state semantics, and samples the next token as a fixed
function of the context it read. Its own record of every request's tokens is the independent
reference: a wrong block table, a stale cached page, a lost state or a bad recompute all make
the context differ from that record.
"""

import random

import pytest
from import_testing import imports_jax

from paged_kv import CacheManager
from runtime.engine_config import CacheConfig, SchedulerConfig
from runtime.scheduling.policies import get_policy
from runtime.scheduling.request import Request, RequestStatus
from runtime.scheduling.scheduler import Scheduler
from runtime.types import SamplingParams

VOCAB = 50


def next_token(context):
    return (sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 + len(context)) % VOCAB + 1


def reference_generation(prompt, params, eos=None):
    """Outputs and finish reason, computed without any scheduler."""
    tokens, outputs = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        outputs.append(token)
        if len(outputs) >= params.min_tokens and (token in params.stop_token_ids or token == eos):
            return outputs, "stop"
        if len(outputs) >= params.max_tokens:
            return outputs, "length"


class FakeDevice:
    def __init__(self, cache: CacheManager):
        self.page_size = cache.page_size
        self.kv = [[None] * cache.page_size for _ in range(cache.pages.num_pages)]
        self.state = [None] * (cache.slots.num_slots if cache.slots else 1)
        self.hybrid = cache.is_hybrid
        self.truth: dict[str, list[int]] = {}

    def add(self, request):
        self.truth[request.request_id] = list(request.prompt_token_ids)

    def step(self, out):
        ps = self.page_size
        for src, dst in out.copy_before:
            self.state[dst] = self.state[src]
        for seq in out.sequences:  # write_kv for the whole batch happens before attention
            assert 0 not in seq.block_table
            for pos, token in enumerate(seq.token_ids, start=seq.start_position):
                self.kv[seq.block_table[pos // ps]][pos % ps] = token
        sampled = {}
        for seq in out.sequences:
            end = seq.start_position + seq.num_new_tokens
            truth = self.truth[seq.request_id]
            assert seq.token_ids == truth[seq.start_position : end]
            context = [self.kv[seq.block_table[p // ps]][p % ps] for p in range(end)]
            assert context == truth[:end], f"{seq.request_id}: paged context differs from the record"
            if self.hybrid:
                assert seq.state_slot != 0
                previous = self.state[seq.state_slot] if seq.has_initial_state else ()
                assert previous == tuple(truth[: seq.start_position]), f"{seq.request_id}: wrong initial state"
                self.state[seq.state_slot] = tuple(context)
            if seq.sample:
                sampled[seq.request_id] = [next_token(context)]
        for src, dst in out.copy_after:
            self.state[dst] = self.state[src]
        return sampled

    def commit(self, out, sampled, scheduler):
        """Record sampled tokens of requests the scheduler still accepted (not aborted)."""
        for seq in out.sequences:
            if seq.request_id in sampled and scheduler.requests.get(seq.request_id) is seq.request:
                self.truth[seq.request_id].extend(sampled[seq.request_id])


def make(page_size=4, num_pages=32, num_state_slots=0, prefix=True, **sched):
    sched.setdefault("max_model_len", 64)
    cache = CacheConfig(page_size, num_pages, num_state_slots, prefix).build_manager()
    return Scheduler(SchedulerConfig(**sched), cache), FakeDevice(cache)


def add(scheduler, device, request_id, prompt, max_tokens=4, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, **kwargs.pop("params", {}))
    request = Request(request_id, list(prompt), params, **kwargs)
    scheduler.add_request(request)
    device.add(request)
    return request


def step(scheduler, device):
    out = scheduler.schedule()
    scheduler.check_invariants()
    assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    assert len(out.sequences) <= scheduler.config.max_num_seqs
    sampled = device.step(out)
    device.commit(out, sampled, scheduler)
    finished = scheduler.update_from_output(out, sampled)
    scheduler.check_invariants()
    return out, finished


def run_to_completion(scheduler, device, max_steps=500):
    outs = []
    while scheduler.has_unfinished():
        outs.append(step(scheduler, device)[0])
        assert len(outs) < max_steps, "no progress: deadlock or livelock"
    return outs


def shape(out):
    return [(s.request_id, s.start_position, s.num_new_tokens, s.sample) for s in out.sequences]


# ---- batching ---------------------------------------------------------------------------------------
def test_chunked_prefill_mixes_with_decodes_under_the_token_budget():
    scheduler, device = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = add(scheduler, device, "a", range(1, 4), max_tokens=3)
    b = add(scheduler, device, "b", range(1, 21), max_tokens=2)
    outs = [step(scheduler, device)[0] for _ in range(4)]
    assert shape(outs[0]) == [("a", 0, 3, True), ("b", 0, 5, False)]
    assert shape(outs[1]) == [("a", 3, 1, True), ("b", 5, 7, False)]
    assert shape(outs[2]) == [("a", 4, 1, True), ("b", 12, 7, False)]
    assert shape(outs[3]) == [("b", 19, 1, True)]  # a finished (3 tokens)
    run_to_completion(scheduler, device)
    for request in (a, b):
        assert (request.output_token_ids, request.finish_reason) == reference_generation(
            request.prompt_token_ids, request.params
        )


def test_long_prefill_threshold_caps_each_chunk():
    scheduler, device = make(max_num_batched_tokens=16, max_num_seqs=2, long_prefill_token_threshold=5)
    add(scheduler, device, "a", range(1, 13), max_tokens=1)
    outs = run_to_completion(scheduler, device)
    assert [shape(o) for o in outs] == [[("a", 0, 5, False)], [("a", 5, 5, False)], [("a", 10, 2, True)]]


def test_max_num_seqs_is_respected():
    scheduler, device = make(max_num_batched_tokens=32, max_num_seqs=2)
    requests = [add(scheduler, device, f"r{i}", [i + 1] * 3, max_tokens=2 + i) for i in range(5)]
    outs = run_to_completion(scheduler, device)
    assert max(len(o.sequences) for o in outs) == 2
    assert {s.request_id for s in outs[0].sequences} == {"r0", "r1"}
    for request in requests:
        assert request.output_token_ids == reference_generation(request.prompt_token_ids, request.params)[0]


def test_stop_tokens_eos_and_min_tokens():
    prompt = [3, 1, 4]
    free_run, _ = reference_generation(prompt, SamplingParams(max_tokens=8))
    scheduler, device = make()
    stop = add(scheduler, device, "stop", prompt, max_tokens=8, params={"stop_token_ids": (free_run[1],)})
    eos = add(scheduler, device, "eos", prompt, max_tokens=8, eos_token_ids=(free_run[0],))
    late = add(scheduler, device, "late", prompt, max_tokens=8, eos_token_ids=(free_run[0],), params={"min_tokens": 3})
    ignore = add(
        scheduler, device, "ignore", prompt, max_tokens=8, eos_token_ids=(free_run[0],), params={"ignore_eos": True}
    )
    run_to_completion(scheduler, device)
    assert (stop.output_token_ids, stop.finish_reason, stop.stop_reason) == (free_run[:2], "stop", free_run[1])
    assert (eos.output_token_ids, eos.finish_reason) == (free_run[:1], "stop")
    assert eos.stop_reason is None  # vLLM: null when EOS ended it, the token id for stop_token_ids
    assert late.output_token_ids == reference_generation(prompt, late.params, eos=free_run[0])[0]
    assert len(late.output_token_ids) >= 3
    assert (ignore.output_token_ids, ignore.finish_reason) == (free_run, "length")


# ---- preemption --------------------------------------------------------------------------------------
def test_preemption_by_recompute_when_pages_run_out():
    # 6 pages x 4 tokens; each request grows to 8 + 12 - 1 = 19 tokens of KV = 5 pages.
    scheduler, device = make(num_pages=7, max_num_batched_tokens=16, max_num_seqs=2, prefix=False)
    a = add(scheduler, device, "a", range(1, 9), max_tokens=12)
    b = add(scheduler, device, "b", range(11, 19), max_tokens=12)
    outs = run_to_completion(scheduler, device)
    preempted = [rid for o in outs for rid in o.preempted_request_ids]
    assert preempted and set(preempted) == {"b"}  # the newer one
    assert b.num_preemptions == len(preempted) and scheduler.stats()["num_preemptions"] == len(preempted)
    recompute = next(
        s for o in outs[1:] for s in o.sequences if s.request_id == "b" and s.start_position == 0 and o is not outs[0]
    )
    assert len(recompute.token_ids) > 8  # prompt + the outputs it had before preemption
    for request in (a, b):
        assert (request.output_token_ids, request.finish_reason) == reference_generation(
            request.prompt_token_ids, request.params
        )
    assert scheduler.stats()["pages_used"] == 0


def test_preempted_request_reuses_its_own_cached_pages():
    scheduler, device = make(num_pages=7, max_num_batched_tokens=16, max_num_seqs=2)
    add(scheduler, device, "a", range(1, 9), max_tokens=12)
    b = add(scheduler, device, "b", range(11, 19), max_tokens=12)
    run_to_completion(scheduler, device)
    assert b.num_preemptions >= 1
    assert b.output_token_ids == reference_generation(b.prompt_token_ids, b.params)[0]
    assert scheduler.stats()["prefix_cache_hit_tokens"] > 0


def test_priority_policy_orders_admission_and_preempts_the_lowest_priority():
    scheduler, device = make(num_pages=7, max_num_batched_tokens=16, max_num_seqs=2, policy="priority", prefix=False)
    low = add(scheduler, device, "low", range(1, 9), max_tokens=12, priority=5, arrival_time=0.0)
    high = add(scheduler, device, "high", range(11, 19), max_tokens=12, priority=0, arrival_time=1.0)
    outs = run_to_completion(scheduler, device)
    assert outs[0].sequences[0].request_id == "high"
    assert {rid for o in outs for rid in o.preempted_request_ids} == {"low"}
    assert high.num_preemptions == 0 and low.num_preemptions >= 1
    for request in (low, high):
        assert request.output_token_ids == reference_generation(request.prompt_token_ids, request.params)[0]


def test_policy_registry():
    assert get_policy("fcfs").name == "fcfs"
    with pytest.raises(ValueError, match="known"):
        get_policy("lottery")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lottery")


# ---- admission errors ----------------------------------------------------------------------------------
def test_a_request_that_can_never_fit_is_rejected_at_add_time():
    scheduler, _ = make(num_pages=5, max_model_len=100)  # 4 pages = 16 tokens of KV
    with pytest.raises(ValueError, match=r"need 5 KV pages of 4 tokens, but the pool has only 4"):
        scheduler.add_request(Request("big", list(range(10)), SamplingParams(max_tokens=8)))
    scheduler.add_request(Request("fits", list(range(10)), SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError, match="max_model_len=100"):
        scheduler.add_request(Request("long", [1] * 100))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Request("empty", []))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("fits", [1]))


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="num_state_slots"):
        CacheConfig(num_state_slots=1)
    with pytest.raises(ValueError, match="num_pages"):
        CacheConfig(num_pages=1)


# ---- abort ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hybrid", [False, True])
def test_abort_waiting_running_and_mid_prefill_frees_everything(hybrid):
    scheduler, device = make(max_num_batched_tokens=8, max_num_seqs=2, num_state_slots=4 if hybrid else 0)
    add(scheduler, device, "decoding", [1, 2, 3], max_tokens=10)
    add(scheduler, device, "prefilling", range(1, 30), max_tokens=4)
    add(scheduler, device, "waiting", [5, 6], max_tokens=4)
    step(scheduler, device)
    step(scheduler, device)
    assert scheduler.requests["prefilling"].num_computed_tokens < 29
    assert scheduler.requests["waiting"].status is RequestStatus.WAITING
    for request_id in ("waiting", "prefilling", "decoding"):
        assert scheduler.abort(request_id)
        scheduler.check_invariants()
    assert not scheduler.abort("decoding") and not scheduler.has_unfinished()
    stats = scheduler.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]


def test_abort_between_schedule_and_update_is_skipped():
    scheduler, device = make()
    a = add(scheduler, device, "a", [1, 2, 3])
    out = scheduler.schedule()
    sampled = device.step(out)
    scheduler.abort("a")
    assert scheduler.update_from_output(out, sampled) == []
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    scheduler.check_invariants()
    assert scheduler.stats()["pages_used"] == 0


def test_protocol_misuse_is_reported():
    scheduler, device = make()
    add(scheduler, device, "a", [1, 2, 3])
    out = scheduler.schedule()
    with pytest.raises(RuntimeError, match="update_from_output"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update_from_output(out, {})


# ---- hybrid prefix caching ------------------------------------------------------------------------------
def test_hybrid_prefix_caching_checkpoints_at_page_boundaries_and_restores():
    scheduler, device = make(num_state_slots=6, max_num_batched_tokens=16, max_num_seqs=2)
    prompt = list(range(1, 11))  # 10 tokens: deepest reusable boundary is 8
    add(scheduler, device, "a", prompt, max_tokens=2)
    out, _ = step(scheduler, device)
    assert shape(out) == [("a", 0, 8, False)] and len(out.copy_after) == 1
    ((running_slot, checkpoint_slot),) = out.copy_after
    assert checkpoint_slot != running_slot
    out, _ = step(scheduler, device)
    assert shape(out) == [("a", 8, 2, True)] and out.copy_after == []
    run_to_completion(scheduler, device)
    assert scheduler.stats()["slots_cached"] == 1

    b = add(scheduler, device, "b", prompt + [42, 43], max_tokens=3)
    out, _ = step(scheduler, device)
    (seq,) = out.sequences
    assert (seq.start_position, seq.has_initial_state) == (8, True)
    assert out.copy_before == [(checkpoint_slot, seq.state_slot)]  # restored from a's checkpoint
    run_to_completion(scheduler, device)
    assert b.num_cached_tokens == 8
    assert b.output_token_ids == reference_generation(b.prompt_token_ids, b.params)[0]


def test_hybrid_chunks_are_cut_at_page_boundaries():
    scheduler, device = make(num_state_slots=8, max_num_batched_tokens=10, max_num_seqs=2)
    add(scheduler, device, "a", range(1, 24), max_tokens=1)
    outs = run_to_completion(scheduler, device)
    ends = [s.start_position + s.num_new_tokens for o in outs for s in o.sequences]
    assert ends == [8, 16, 20, 23]  # budget 10 -> 8 aligned; 20 = deepest reusable boundary
    assert sum(len(o.copy_after) for o in outs) == 3


# ---- random workload -------------------------------------------------------------------------------------
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_invariants_and_outputs(seed, prefix, hybrid):
    rng = random.Random(seed * 4 + prefix * 2 + hybrid)
    page_size = rng.choice([2, 4])
    scheduler, device = make(  # a pool barely larger than one request at max_model_len
        page_size=page_size,
        num_pages=-(-21 // page_size) + 1 + rng.randrange(3),
        num_state_slots=5 if hybrid else 0,
        prefix=prefix,
        max_num_batched_tokens=rng.choice([8, 12, 16]),
        max_num_seqs=rng.choice([2, 3, 4]),
        max_model_len=22,
        long_prefill_token_threshold=rng.choice([0, 6]),
        policy=rng.choice(["fcfs", "priority"]),
    )
    prefixes = [[rng.randrange(1, VOCAB + 1) for _ in range(rng.randrange(0, 10))] for _ in range(3)]
    pending = 30
    requests, aborted = [], set()
    for _step_index in range(2000):
        if pending and rng.random() < 0.7:
            pending -= 1
            prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB + 1) for _ in range(rng.randrange(1, 6))]
            requests.append(
                add(
                    scheduler,
                    device,
                    f"r{len(requests)}",
                    prompt,
                    max_tokens=rng.randrange(1, 9),
                    priority=rng.randrange(3),
                    params={"stop_token_ids": (7,)},
                )
            )
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort(victim)
            aborted.add(victim)
            scheduler.check_invariants()
        out = scheduler.schedule()
        scheduler.check_invariants()
        sampled = device.step(out)
        if out.sequences and rng.random() < 0.05:
            victim = rng.choice(out.sequences).request_id
            aborted.add(victim)
            scheduler.abort(victim)
        device.commit(out, sampled, scheduler)
        scheduler.update_from_output(out, sampled)
        scheduler.check_invariants()
        if not pending and not scheduler.has_unfinished():
            break
    else:
        pytest.fail("workload did not drain: deadlock or livelock")

    stats = scheduler.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    assert stats["slots_used"] == 0 and stats["slots_free"] + stats["slots_cached"] == stats["slots_total"]
    if not prefix:
        assert stats["pages_cached"] == 0 and stats["slots_cached"] == 0
    for request in requests:
        assert request.is_finished
        if request.request_id not in aborted:
            expected = reference_generation(request.prompt_token_ids, request.params)
            assert (request.output_token_ids, request.finish_reason) == expected, request.request_id
    assert stats["num_preemptions"] > 0


def test_scheduling_modules_do_not_import_jax():
    assert not imports_jax(
        "paged_kv",
        "runtime.scheduling.scheduler",
        "runtime.engine_config",
        "runtime.scheduling.request",
        "runtime.scheduling.policies",
    )
