"""No compile in the serving loop: an engine started with `aot_compile_all` serves a mixed
workload (greedy, sampled with penalties, logit bias and min_tokens, logprobs, prompt logprobs,
stop strings, n > 1 sharing a prompt, a grammar) without a single XLA compilation after
start-up — counted by JAX's own compile log (`jax_log_compiles`), not by our bookkeeping."""

import logging

import jax
import numpy as np
import pytest
from engine_testing import drain

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig
from runtime.steps.executables import CompileAfterStartup
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.types import EngineRequest, SamplingParams, StructuredOutput


class CompileCounter(logging.Handler):
    """Every 'Compiling ...' record JAX emits under jax_log_compiles."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.compiled: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling ") or "XLA compilation" in message:
            self.compiled.append(message.split("\n")[0][:160])


def mixed_requests(vocab: int) -> list[EngineRequest]:
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(3, vocab, size=n).tolist()
    shared = prompt(40)
    sampled = dict(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=6, ignore_eos=True)
    return [
        EngineRequest("greedy", prompt(70), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
        EngineRequest(
            "penalties",
            prompt(9),
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, **sampled),
        ),
        EngineRequest(
            "bias+min_tokens",
            prompt(12),
            SamplingParams(max_tokens=5, temperature=0.0, min_tokens=3, logit_bias={5: 3.0, 9: -100.0}),
        ),
        EngineRequest(
            "logprobs", prompt(20), SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
        ),
        EngineRequest("prompt_logprobs", prompt(30), SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True)),
        EngineRequest(
            "stop_string",
            prompt(5),
            SamplingParams(max_tokens=10, stop=("a", "the"), **{k: v for k, v in sampled.items() if k != "max_tokens"}),
        ),
        EngineRequest(
            "grammar",
            prompt(6),
            SamplingParams(max_tokens=6, temperature=0.0, structured_output=StructuredOutput("regex", "[ab]+")),
        ),
    ] + [EngineRequest(f"n{i}", shared, SamplingParams(**dict(sampled, seed=i))) for i in range(3)]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_mixed_workload_compiles_nothing_after_startup(family, tiny_checkpoint):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_checkpoint(family)),
            dtype="float32",
            page_size=16,
            num_pages=64,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            token_buckets=(8, 64),
            max_model_len=256,
            aot_compile=True,
            aot_compile_all=True,
        ),
        progress=False,
    )
    ex = engine.executables
    assert ex.sealed
    counter = CompileCounter()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        for request in mixed_requests(engine.model.cfg.vocab_size):
            engine.add_request(request)
        done = drain(engine)
        # a second wave reuses the prompt shared by n > 1: a prefix-cache hit (state copy on hybrids)
        for request in mixed_requests(engine.model.cfg.vocab_size)[-3:]:
            engine.add_request(EngineRequest(request.request_id + "'", request.prompt_token_ids, request.params))
        done.update(drain(engine))
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    assert counter.compiled == [], f"compiled after start-up: {counter.compiled}"
    assert all(out.outputs[0].finish_reason in ("stop", "length") for out in done.values()), done
    assert len(done["logprobs"].outputs[0].logprobs) == 4
    assert len(done["logprobs"].outputs[0].logprobs[0].top) == 3
    assert done["prompt_logprobs"].prompt_logprobs is not None
    assert len(done["prompt_logprobs"].prompt_logprobs) == 30
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    # anything outside the sealed set is refused, not compiled: a bitmask width never compiled
    S = ex.seq_buckets[0]
    meta = SamplingMetadata.from_params(
        [SamplingParams()] * S, [0] * S, [[]] * S, [[]] * S, pad_to=S, row_params=not ex.row_params_in_table
    )
    hidden = np.zeros((engine.config.max_num_seqs, engine.model.cfg.hidden_size), np.float32)
    with pytest.raises(CompileAfterStartup, match="not compiled at start-up"):
        ex.run_sampler(engine.model.params, hidden, meta, 0, bitmask=np.zeros((S, 1), np.int32), table=engine.table)
    # the request table holds the per-row parameters: metadata that carries them too is refused
    full = SamplingMetadata.from_params([SamplingParams()] * S, [0] * S, [[]] * S, [[]] * S, pad_to=S)
    with pytest.raises(ValueError, match="request table"):
        ex.run_sampler(engine.model.params, hidden, full, 0, table=engine.table)


@pytest.mark.slow  # ~25 s on 2 cores (its own sealed engine); tests/test_host_tier.py checks the tier's part by default
def test_host_tier_transfers_compile_nothing_after_startup(tiny_checkpoint):
    """The host tier's gathers (offloads) and scatters (loads) are compiled at start-up with the
    step executables: a chat that evicts conversations to host and loads them back compiles nothing."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_checkpoint("qwen3_5")),
            dtype="float32",
            page_size=8,
            num_pages=14,
            num_state_slots=5,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            token_buckets=(8, 32),
            max_model_len=64,
            load_tokenizer=False,
            kv_offloading_size=0.01,
            aot_compile=True,
            aot_compile_all=True,
        ),
        progress=False,
    )
    assert engine.executables.sealed and engine.host_tier.sealed and engine.host_tier.executables
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(3, engine.model.cfg.vocab_size, size=n).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    counter, logger = CompileCounter(), logging.getLogger("jax")
    logger.addHandler(counter)
    jax.config.update("jax_log_compiles", True)
    try:
        for round_ in range(2):  # a prompt, fillers that evict it to host, the prompt back (a host hit)
            first = draw(26)
            engine.add_request(EngineRequest(f"first{round_}", first, params))
            back = first + drain(engine)[f"first{round_}"].outputs[0].token_ids + draw(3)
            for i in range(4):
                engine.add_request(EngineRequest(f"fill{round_}.{i}", draw(40), params))
            drain(engine)
            engine.add_request(EngineRequest(f"back{round_}", back, params))
            drain(engine)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(counter)
    stats = engine.stats()
    assert counter.compiled == [], f"compiled after start-up: {counter.compiled}"
    assert stats["host_cache_offloads"] > 0 and stats["host_cache_pages_loaded"] > 0, stats
