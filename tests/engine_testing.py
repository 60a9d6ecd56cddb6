"""Driving an LLMEngine to completion in tests, checking the scheduler's accounting each step."""


def drain(engine, check_invariants: bool = True) -> dict:
    """Step until nothing is left; -> {request_id: final RequestOutput}."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_invariants:
            engine.scheduler.check_invariants()
    return done
