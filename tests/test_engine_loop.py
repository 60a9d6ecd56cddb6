"""The one engine loop (`runtime/engine/loop.py`) over a hand-made engine: no JAX, no threads.

Each test drives `EngineLoop.run_once` itself and checks what every sink received.
"""

import concurrent.futures

from runtime.engine.loop import EngineLoop
from runtime.types import EngineDeadError, EngineRequest, RequestDelta, SamplingParams, StructuredOutput
from runtime.validation import validate_request


class CountingEngine:
    """Each step gives every request its next token (1, 2, ...) and ends it after `max_tokens`."""

    def __init__(self, fail_at_step: int | None = None):
        self.running: dict[str, list] = {}
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.aborted: list[str] = []

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def add_request(self, request: EngineRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        self.running[request.request_id] = [request.params.max_tokens, 0]

    def abort(self, request_id: str):
        if self.running.pop(request_id, None) is None:
            return None
        self.aborted.append(request_id)
        return RequestDelta(request_id, finish_reason="abort")

    def step(self) -> list[RequestDelta]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("the device is gone")
        deltas = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            deltas.append(RequestDelta(rid, [state[1]], str(state[1]), finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return deltas


def _request(rid: str, max_tokens: int = 3, prompt=(5, 6), grammar=None) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, structured_output=grammar))


def _loop(engine, **kwargs):
    received: dict[str, list] = {}
    batches: list[int] = []

    def deliver(deliveries):
        batches.append(len(deliveries))
        for sink, item in deliveries:
            received.setdefault(sink, []).append(item)

    return EngineLoop(engine, deliver, **kwargs), received, batches


def _texts(items) -> str:
    return "".join(item.new_text for item in items)


def test_each_delta_reaches_its_request_once_per_step_and_the_sink_closes_when_finished():
    engine = CountingEngine()
    loop, received, batches = _loop(engine)
    loop.add(_request("a", 3), "sink-a")
    loop.add(_request("b", 1), "sink-b")
    while loop.run_once(block=False) and engine.has_unfinished():
        pass
    assert _texts(received["sink-a"]) == "123" and received["sink-a"][-1].finish_reason == "length"
    assert [d.new_token_ids for d in received["sink-b"]] == [[1]] and received["sink-b"][0].finished
    assert batches[0] == 2  # one delivery per iteration, both requests in it
    assert loop.num_open == 0


def test_refusals_duplicates_and_aborts():
    engine = CountingEngine()
    loop, received, _ = _loop(engine)
    loop.add(_request("a", 10), "sink-a")
    loop.add(_request("a", 10), "sink-dup")
    loop.add(_request("bad", prompt=()), "sink-bad")
    loop.run_once(block=False)
    assert isinstance(received["sink-dup"][0], ValueError) and "already in use" in str(received["sink-dup"][0])
    assert isinstance(received["sink-bad"][0], ValueError)
    loop.abort("a")
    loop.abort("unknown")  # harmless
    loop.run_once(block=False)
    assert received["sink-a"][-1].finish_reason == "abort" and engine.aborted == ["a"]
    assert loop.num_open == 0


def test_a_dead_engine_fails_every_open_request_and_the_refusals_of_its_iteration():
    engine = CountingEngine(fail_at_step=2)
    loop, received, _ = _loop(engine)
    loop.add(_request("a", 10), "sink-a")
    loop.add(_request("b", 10), "sink-b")
    loop.run_once(block=False)
    loop.add(_request("bad", prompt=()), "sink-bad")  # refused in the iteration whose step dies
    loop.run()  # returns: the loop is dead
    assert isinstance(loop.death, RuntimeError)
    for sink in ("sink-a", "sink-b"):
        assert isinstance(received[sink][-1], EngineDeadError), received[sink]
    assert isinstance(received["sink-bad"][0], ValueError)
    assert loop.num_open == 0


def test_stop_aborts_what_is_left():
    engine = CountingEngine()
    loop, _, _ = _loop(engine)
    loop.add(_request("a", 10), "sink-a")
    loop.run_once(block=False)
    loop.stop()
    assert loop.run_once(block=False) is False and loop.stopped
    assert engine.aborted == ["a"] and not engine.has_unfinished()


class SlowCompiler:
    """Grammar futures the test resolves by hand."""

    def __init__(self):
        self.futures: dict = {}

    def submit(self, grammar):
        return self.futures.setdefault(grammar.key, concurrent.futures.Future())


def test_a_request_waits_for_its_grammar_off_the_loop_and_joins_when_it_compiled():
    engine, compiler = CountingEngine(), SlowCompiler()
    loop, received, _ = _loop(engine, compiler=compiler)
    grammar = StructuredOutput("regex", "a+")
    loop.add(_request("g", 2, grammar=grammar), "sink-g")
    loop.add(_request("p", 2), "sink-p")
    loop.run_once(block=False)
    assert "g" not in engine.running and "sink-p" in received  # the plain one runs meanwhile
    compiler.futures[grammar.key].set_result(object())
    loop.run_once(block=False)
    assert "g" in engine.running and received["sink-g"][0].new_token_ids == [1]
    loop.add(_request("g2", 1, grammar=grammar), "sink-g2")  # compiled already: joins at once
    loop.run_once(block=False)
    assert received["sink-g2"][0].finished


def test_an_aborted_request_never_joins_after_its_grammar_compiled():
    engine, compiler = CountingEngine(), SlowCompiler()
    loop, received, _ = _loop(engine, compiler=compiler)
    grammar = StructuredOutput("regex", "b+")
    loop.add(_request("g", 2, grammar=grammar), "sink-g")
    loop.run_once(block=False)
    loop.abort("g")
    loop.run_once(block=False)
    compiler.futures[grammar.key].set_result(object())
    loop.run_once(block=False)
    assert "g" not in engine.running and "sink-g" not in received and loop.num_open == 0


def test_validation_marks_the_request_it_returns():
    request = _request("v", 3)
    assert not request.validated
    checked = validate_request(request, vocab_size=100, max_model_len=64)
    assert checked.validated and checked.params == request.params
