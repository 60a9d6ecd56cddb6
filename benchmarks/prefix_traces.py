"""Request traces for the prefix-cache simulator: sessions of turns, as token ids, from a seed.

    trace = make_trace("chat", vocab_size=248320, seed=0)
    trace[0].prompt(1)      # the prompt of the session's second turn

A `Session` is a conversation: turn k's prompt is every earlier turn's new tokens and output,
then turn k's new tokens (a user message, a tool result, or the whole prompt of a one-turn
session). Outputs are fixed in the trace, so the simulator's fake model "generates" them and
the next turn's prompt contains them exactly, as a chat template would. Turn k+1 arrives
`think_steps` scheduler steps after turn k finished; a session starts at `start_step`.

Traces (lengths in tokens):
  chat           multi-turn chat: one shared system prompt (1,500), 2-8 turns per session, user
                 messages 20-400, responses 50-1,000 (log-normal)
  short_chat     chat with a 200-token system prompt, 2-4 turns, user 10-100, responses 20-200:
                 most prompts are shorter than vLLM's 528-token align block
  few_shot       one-turn prompts over 4 long few-shot prefixes (instruction 200 + 12 examples of
                 100-400): each takes the first 1-12 examples, so requests share a prefix and
                 diverge at different depths inside pages, then a question of 20-100
  agent          agent loops: a shared system + tools prompt (3,000), a task, then 4-16 steps of
                 a tool call (output 30-200) followed by a tool result (100-3,000)
  fixed, mixed, shared_prefix, long_context
                 `benchmarks/workloads.py` at scale 1 (one-turn sessions, all arriving at once)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.workloads import WORKLOADS, make_workload, token_id_range

TRACES = ("chat", "few_shot", "agent", *WORKLOADS, "short_chat")  # the index seeds each stream: append only


@dataclass(frozen=True)
class Turn:
    new_tokens: tuple[int, ...]  # appended to the conversation before this turn's request
    output: tuple[int, ...]  # what the model answers (fixed by the trace)


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    start_step: int = 0
    think_steps: int = 0

    def prompt(self, k: int) -> list[int]:
        tokens: list[int] = []
        for turn in self.turns[:k]:
            tokens += turn.new_tokens + turn.output
        return tokens + list(self.turns[k].new_tokens)


class _Tokens:
    """Random token ids above the special-token region, one stream per trace seed."""

    def __init__(self, rng: np.random.Generator, vocab_size: int):
        self.rng = rng
        self.low, self.high = token_id_range(vocab_size)

    def __call__(self, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.rng.integers(self.low, self.high, size=int(n)))

    def length(self, low: int, high: int, median: float) -> int:
        return int(np.clip(round(self.rng.lognormal(np.log(median), 0.8)), low, high))


def _chat(
    tok: _Tokens,
    n: int,
    spread: int,
    system_len: int = 1500,
    max_turns: int = 8,
    user=(20, 400, 80),
    response=(50, 1000, 250),
) -> list[Session]:
    system = tok(system_len)
    sessions = []
    for i in range(n):
        turns = []
        for k in range(int(tok.rng.integers(2, max_turns + 1))):
            message = tok(tok.length(*user))
            turns.append(Turn((system if k == 0 else ()) + message, tok(tok.length(*response))))
        sessions.append(Session(f"chat{i}", tuple(turns), int(tok.rng.integers(0, spread)), think_steps=20))
    return sessions


def _short_chat(tok: _Tokens, n: int, spread: int) -> list[Session]:
    return _chat(tok, n, spread, system_len=200, max_turns=4, user=(10, 100, 40), response=(20, 200, 60))


def _few_shot(tok: _Tokens, n: int, spread: int) -> list[Session]:
    tasks = [(tok(200), [tok(int(tok.rng.integers(100, 401))) for _ in range(12)]) for _ in range(4)]
    sessions = []
    for i in range(n):
        instruction, examples = tasks[int(tok.rng.integers(0, len(tasks)))]
        shots = sum(examples[: int(tok.rng.integers(1, 13))], ())
        prompt = instruction + shots + tok(int(tok.rng.integers(20, 101)))
        sessions.append(
            Session(f"shot{i}", (Turn(prompt, tok(int(tok.rng.integers(20, 101)))),), int(tok.rng.integers(0, spread)))
        )
    return sessions


def _agent(tok: _Tokens, n: int, spread: int) -> list[Session]:
    system = tok(3000)
    sessions = []
    for i in range(n):
        turns = [Turn(system + tok(int(tok.rng.integers(100, 301))), tok(int(tok.rng.integers(30, 201))))]
        for _ in range(int(tok.rng.integers(4, 17))):
            turns.append(Turn(tok(tok.length(100, 3000, 600)), tok(int(tok.rng.integers(30, 201)))))
        sessions.append(Session(f"agent{i}", tuple(turns), int(tok.rng.integers(0, spread)), think_steps=5))
    return sessions


def make_trace(
    name: str,
    *,
    vocab_size: int,
    seed: int = 0,
    num_sessions: int | None = None,
    spread_steps: int = 2000,
    max_model_len: int = 32768,
) -> list[Session]:
    """The `name` trace; identical for identical arguments."""
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose from {TRACES}")
    if name in WORKLOADS:
        requests = make_workload(
            name, vocab_size=vocab_size, seed=seed, num_requests=num_sessions, max_model_len=max_model_len
        )
        rng = np.random.default_rng([seed, 7])
        low, high = token_id_range(vocab_size)
        return [
            Session(f"{name}{i}", (Turn(r.prompt_ids, tuple(int(t) for t in rng.integers(low, high, r.max_tokens))),))
            for i, r in enumerate(requests)
        ]
    tok = _Tokens(np.random.default_rng([seed, TRACES.index(name)]), vocab_size)
    default_n = {"chat": 256, "short_chat": 256, "few_shot": 512, "agent": 64}[name]
    build = {"chat": _chat, "short_chat": _short_chat, "few_shot": _few_shot, "agent": _agent}[name]
    return build(tok, default_n if num_sessions is None else num_sessions, spread_steps)
