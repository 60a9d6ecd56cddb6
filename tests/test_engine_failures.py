"""Failures stay local: a step that raises ends only its own requests (with an error output),
frees their pages and slots, and the engine keeps serving; model-dependent validation happens
in one place (`runtime.validation`) before anything reaches the device."""

import pytest
from engine_testing import FailingStep, drain

from runtime.engine.llm_engine import EngineDeadError, LLMEngine
from runtime.engine_config import EngineConfig
from runtime.types import EngineRequest, SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint("qwen3_5")),
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_pages=80,
            max_model_len=256,
        )
    )


def assert_nothing_held(engine):
    engine.scheduler.check_invariants()
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"], s
    assert s["slots_free"] + s["slots_cached"] == s["slots_total"], s
    assert s["num_running"] == s["num_waiting"] == 0, s
    assert s["table_rows_used"] == 0, s  # every request-table row is free again


def _serve(engine, requests):
    for r in requests:
        engine.add_request(r)
    return drain(engine)


@pytest.mark.parametrize("fail", ["run_sampler", "run_table_backbone"])
def test_failed_step_fails_only_its_requests_then_50_succeed(engine, fail):
    sampled = SamplingParams(max_tokens=3, temperature=0.8, seed=1)
    for i in range(3):
        engine.add_request(EngineRequest(f"doomed-{fail}-{i}", [5 + i, 6, 7], sampled))
    real = engine.executables
    engine.executables = FailingStep(real, fail, times=1)
    try:
        failed = drain(engine)
    finally:
        engine.executables = real
    assert set(failed) == {f"doomed-{fail}-{i}" for i in range(3)}
    for out in failed.values():
        assert out.finished and out.finish_reason == "error" and "RuntimeError" in out.error
    assert_nothing_held(engine)

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    done = _serve(engine, [EngineRequest(f"after-{fail}-{i}", [3 + i % 7, 9, 11], params) for i in range(50)])
    assert len(done) == 50 and all(o.error is None and len(o.token_ids) == 2 for o in done.values())
    assert_nothing_held(engine)


def test_failure_after_the_caches_were_donated_is_fatal(tiny_checkpoint):
    engine = LLMEngine(
        EngineConfig(
            aot_compile=False,  # compile what the test runs (start-up compiles: test_executable_table)
            model=str(tiny_checkpoint("llama")),
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_pages=20,
            max_model_len=64,
            fuse_greedy=False,
        )
    )
    engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=2)))
    engine.executables = FailingStep(engine.executables, "run_table_backbone", after_real_call=True)
    with pytest.raises(EngineDeadError):
        engine.step()


@pytest.mark.parametrize(
    "params,param",
    [
        (dict(min_tokens=2, stop_token_ids=[1099511627776]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(3, 36))), "stop_token_ids"),  # 33 > MAX_STOP_TOKEN_IDS (sampler width)
        (dict(min_tokens=100), "min_tokens"),  # default max_tokens 16
        (dict(logit_bias={2**40: 1.0}), "logit_bias"),
        (dict(max_tokens=300), "max_tokens"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(engine, params, param):
    with pytest.raises(SamplingParamsError) as err:
        engine.add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(**params)))
    assert err.value.param == param
    assert_nothing_held(engine)


def test_huge_prompt_ids_and_empty_prompt_are_refused(engine):
    for prompt in ([1, 2**40], []):
        with pytest.raises(SamplingParamsError) as err:
            engine.add_request(EngineRequest("bad", prompt, SamplingParams()))
        assert err.value.param == "prompt"


def test_top_k_beyond_int32_is_clipped_to_the_vocabulary(engine):
    """vLLM's rule: a top_k >= the vocabulary keeps every token, the same as no top_k."""
    prompt = [4, 8, 15, 16, 23, 42]
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True)
    huge = _serve(engine, [EngineRequest("huge", prompt, seeded.replace(top_k=2147483648))])["huge"]
    plain = _serve(engine, [EngineRequest("plain", prompt, seeded)])["plain"]
    assert huge.error is None and huge.token_ids == plain.token_ids
    assert_nothing_held(engine)


def test_a_step_that_always_fails_kills_the_engine(engine):
    """A device that fails every step (without losing the caches) is as dead as one that lost them."""
    real = engine.executables
    engine.executables = FailingStep(real, "run_table_backbone", times=-1)
    try:
        engine.add_request(EngineRequest("forever-0", [5, 6, 7], SamplingParams(max_tokens=2)))
        errors = engine.step()
        assert [o.finish_reason for o in errors] == ["error"]
        engine.add_request(EngineRequest("forever-1", [5, 6, 7], SamplingParams(max_tokens=2)))
        engine.step()
        engine.add_request(EngineRequest("forever-2", [5, 6, 7], SamplingParams(max_tokens=2)))
        with pytest.raises(EngineDeadError, match="3 steps in a row"):
            engine.step()
    finally:
        engine.executables = real
    assert_nothing_held(engine)  # the fatal step still ended its requests


def test_a_request_the_server_validated_is_not_validated_again(engine, monkeypatch):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    checked = engine.validate_request(EngineRequest("checked", [5, 6, 7], params))
    assert checked.validated
    seen = []
    real = engine.validate_request
    monkeypatch.setattr(engine, "validate_request", lambda request: seen.append(request.request_id) or real(request))
    done = _serve(engine, [checked, EngineRequest("python-caller", [5, 6, 7], params)])
    assert seen == ["python-caller"]  # an unmarked request (built in Python) is still checked
    assert done["checked"].token_ids == done["python-caller"].token_ids and len(done["checked"].token_ids) == 2
    assert_nothing_held(engine)
