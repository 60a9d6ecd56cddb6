"""The device-resident request table (runtime/steps/table_host.py, runtime/steps/table_device.py).

The reference is the host batch builder `runtime.steps.inputs.build_batch` (the engine's builder before
the table; attention DP still uses it): over random ragged steps — prefill chunks, decodes whose
token is still on the device (placeholders), placements with prefix hits (start > 0) that
overflow the step's page writes, preemptions and readmissions, finishes, padding rows — the batch
`prepare` gathers on the device equals `build_batch` of the same step with the real tokens, and
every row is free again at the end. The sampling parameters each row holds from its placement,
gathered for a step's rows (`row_sampling`), equal the host builder's
`SamplingMetadata.from_params` of the step's requests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from models.batch import ForwardBatch
from runtime.buckets import bucket_for
from runtime.scheduled import PLACEHOLDER_TOKEN, ScheduledSequence, SchedulerOutput
from runtime.steps.inputs import build_batch
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.table_device import apply_write, init_table, prepare, row_sampling
from runtime.steps.table_host import ROW_PARAMS, RequestTableHost
from runtime.types import SamplingParams

S, PAGE, MB, BUCKETS = 4, 4, 24, (8, 16, 32)


@dataclasses.dataclass(eq=False)
class FakeRequest:
    request_id: str
    allocation: object = None
    computed: int = 0
    pages: list = dataclasses.field(default_factory=list)
    slot: int = 0
    last_token: int | None = None  # sampled in the previous step, still "on the device"
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)


class Simulation:
    """Random steps over at most S running requests; pages come from one counter (unique)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.running: list[FakeRequest] = []
        self.next_id = self.next_page = 0
        self.free_slots = list(range(1, S + 3))

    def _pages(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n + 1, self.next_page + 1))

    def _place(self) -> FakeRequest:
        self.next_id += 1
        rng = self.rng
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 5])),
            min_p=float(rng.choice([0.0, 0.05])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, -0.25])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            seed=int(rng.integers(0, 2**40)),
        )
        req = FakeRequest(f"r{self.next_id}", allocation=object(), slot=self.free_slots.pop(0), params=params)
        req.computed = int(self.rng.choice([0, 0, PAGE * self.rng.integers(1, 14)]))  # a prefix hit
        req.pages = self._pages(-(-req.computed // PAGE))
        self.running.append(req)
        return req

    def _end(self, req: FakeRequest) -> None:
        self.running.remove(req)
        req.allocation = None
        self.free_slots.append(req.slot)

    def step(self, prev_tokens: np.ndarray) -> tuple[SchedulerOutput, SchedulerOutput]:
        """-> (the step as the engine schedules it, with placeholders; the same with real tokens).
        prev_tokens [S]: the last step's sampled tokens by batch position (filled here)."""
        for req in list(self.running):
            if self.rng.random() < 0.15 or len(req.pages) > MB - 5:
                self._end(req)  # finished, aborted or preempted (a readmission is a new placement)
                req.last_token = None
        while len(self.running) < S and self.rng.random() < 0.6:
            self._place()
        out, true = SchedulerOutput(), SchedulerOutput()
        budget = BUCKETS[-1]
        for req in self.rng.permutation(self.running):
            if budget == 0 or self.rng.random() < 0.2:
                req.last_token = None  # not scheduled: its token reached the host meanwhile
                continue
            n = 1 if req.last_token is not None else int(self.rng.integers(1, min(budget, 12) + 1))
            tokens = list(self.rng.integers(0, 1000, n))
            shown = tokens
            if req.last_token is not None:
                tokens, shown = [req.last_token], [PLACEHOLDER_TOKEN]
            need = -(-(req.computed + n) // PAGE) + int(self.rng.random() < 0.3)  # sometimes a page ahead
            req.pages += self._pages(max(0, need - len(req.pages)))
            for o, ids in ((out, shown), (true, tokens)):
                o.sequences.append(
                    ScheduledSequence(req, ids, req.computed, list(req.pages), req.slot, req.computed > 0, sample=True)
                )
            req.computed += n
            budget -= n
        prev_tokens[:] = self.rng.integers(0, 1000, S)
        for i, seq in enumerate(out.sequences):
            seq.request.last_token = int(prev_tokens[i]) if self.rng.random() < 0.7 else None
        return out, true


@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_matches_the_host_batch_builder(seed):
    host = RequestTableHost(S, PAGE, BUCKETS[-1])
    table = init_table(S, MB)
    run_prepare = jax.jit(functools.partial(prepare, page_size=PAGE))
    write = jax.jit(apply_write)
    sim = Simulation(seed)
    prev_tokens = np.zeros(S, np.int32)
    overflowed = placeholders = 0
    for _ in range(40):
        sampled = prev_tokens.copy()  # what the previous step sampled, as it lies on the device
        out, true = sim.step(prev_tokens)
        if out.is_empty:
            continue
        T = bucket_for(max(out.num_batched_tokens, len(out.sequences)), BUCKETS)
        step, writes = host.plan(out, T)
        overflowed += bool(writes)
        placeholders += int((step.host_tokens == PLACEHOLDER_TOKEN).sum())
        for w in writes:
            table = write(table, w)
        table, batch = run_prepare(table, step, sampled)
        expected = build_batch(true, token_buckets=BUCKETS, max_num_seqs=S, max_blocks_per_seq=MB, page_size=PAGE)
        for f in dataclasses.fields(ForwardBatch):
            np.testing.assert_array_equal(np.asarray(getattr(batch, f.name)), getattr(expected, f.name), err_msg=f.name)
        n = len(true.sequences)
        host_meta = SamplingMetadata.from_params(
            [q.request.params for q in true.sequences], [0] * n, [[]] * n, [[]] * n, pad_to=S
        )
        on_device = row_sampling(table, S)
        for name in ROW_PARAMS:
            np.testing.assert_array_equal(np.asarray(on_device[name]), getattr(host_meta, name), err_msg=name)
    assert overflowed and placeholders  # the rare paths ran
    for req in list(sim.running):
        sim._end(req)
    host.sweep()
    assert host.num_used == 0


def test_a_request_without_a_seed_keeps_the_one_drawn_at_its_placement():
    """Unseeded rows get a seed from the table's rng when placed and keep it every step (the
    sampler folds in the token index); a new placement draws anew."""
    host = RequestTableHost(S, PAGE, BUCKETS[-1], rng=np.random.default_rng(3))
    table, _write = init_table(S, MB), jax.jit(apply_write)
    req = FakeRequest("r", allocation=object(), pages=[1], params=SamplingParams(temperature=1.0))
    seeds = []
    for start, placement in ((0, req.allocation), (4, req.allocation), (0, object())):
        req.allocation = placement
        step, _ = host.plan(SchedulerOutput([ScheduledSequence(req, [5] * 4, start, [1, 2], 0, start > 0, True)]), 8)
        table, _ = jax.jit(functools.partial(prepare, page_size=PAGE))(table, step, np.zeros(S, np.int32))
        seeds.append(int(row_sampling(table, 1)["seeds"][0]))
    ref = np.random.default_rng(3)
    first, second = int(ref.integers(0, 2**32)), int(ref.integers(0, 2**32))
    assert seeds == [first, first, second]


def test_a_placeholder_before_the_last_token_is_refused():
    host = RequestTableHost(S, PAGE, BUCKETS[-1])
    req = FakeRequest("r", allocation=object(), pages=[1])
    out = SchedulerOutput([ScheduledSequence(req, [PLACEHOLDER_TOKEN, 5], 0, [1], 0, False, True)])
    with pytest.raises(RuntimeError, match="only its last token"):
        host.plan(out, 8)


# ---- the engine on the table ------------------------------------------------------------------------
def test_engine_64_sequences_preempted_aborted_and_stopped_match_hf(tiny_checkpoint, hf_model):
    """64 greedy requests at once on 64 table rows, a page pool small enough to preempt, chunked
    prefill, four aborts mid-flight and stop tokens at various positions: every finished request
    equals HF `generate`, and at the end every row, page and slot is free."""
    from engine_testing import Outputs, drain
    from hf_reference import assert_greedy_match, hf_greedy
    from test_engine_hf import assert_all_free

    from runtime.engine.llm_engine import LLMEngine
    from runtime.engine_config import EngineConfig
    from runtime.types import EngineRequest, SamplingParams

    path = tiny_checkpoint("llama")
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            page_size=16,
            num_pages=40,
            max_num_seqs=64,
            max_num_batched_tokens=128,
            max_model_len=128,
            enable_prefix_caching=False,
            token_buckets=(64, 128),  # the subject is the table, not the buckets: compile only what runs
            aot_compile=False,
        )
    )
    hf = hf_model("llama")
    rng = np.random.default_rng(5)
    vocab, n = engine.model.cfg.vocab_size, 8
    sizes = 16 * rng.integers(0, 3, 64) + rng.integers(12, 16, 64)  # every request grows a page while decoding
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in sizes]
    expected = [hf_greedy(hf, p, n) for p in prompts]
    for i, (p, (tokens, _)) in enumerate(zip(prompts, expected)):
        stop = [tokens[i % n]] if i % 3 == 0 else []  # a stop token at position i % 8
        engine.add_request(
            EngineRequest(
                f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop_token_ids=stop)
            )
        )
    aborted = {"r1", "r2", "r40", "r63"}
    outputs = Outputs()
    for _ in range(3):
        outputs.step(engine)
        assert engine.request_table.num_used <= len(engine.scheduler.running)
    for rid in aborted:
        assert engine.abort(rid) is not None
    done = drain(engine, outputs=outputs)
    assert engine.stats()["num_preemptions"] > 0, "the page pool was meant to force preemptions"
    assert_all_free(engine)
    for i, (tokens, scores) in enumerate(expected):
        if f"r{i}" in aborted:
            continue
        want = tokens[: tokens.index(tokens[i % n]) + 1] if i % 3 == 0 else tokens
        assert_greedy_match(done[f"r{i}"].outputs[0].token_ids, want, scores, f"prompt {i}")


def test_the_host_side_imports_no_jax():
    from import_testing import imports_jax

    assert not imports_jax("runtime.steps.table_host")
