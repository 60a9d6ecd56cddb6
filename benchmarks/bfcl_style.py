"""BFCL-style function-calling checks against a running server (grammar-forced calls).

    python -m benchmarks.bfcl_style --url http://127.0.0.1:8000 --json out.json

The Berkeley Function Calling Leaderboard's own package (`bfcl-eval`) would downgrade numpy,
networkx and filelock in our environment, so this script builds cases of the same kinds
itself: `simple` (one function, one question), `multiple` (several functions, the question
needs one), `parallel` (one function, the question needs several calls) and
`parallel_multiple` (several functions, several calls). Each case is sent with
`tool_choice: "required"` (parallel cases with `parallel_tool_calls: true`, the others false)
and every emitted call is checked: its arguments parse as JSON and validate against the
function's schema (`jsonschema`), and its name is one of the case's functions. Reported per
category: requests, calls emitted, the valid-call rate, requests whose answer was cut before a
complete call (`max_tokens`), and two accuracy figures a grammar does not guarantee (the
expected function chosen; the expected number of calls), which depend on the model.

BFCL's schemas leave `additionalProperties` open, so a weak model may keep adding keys until
`max_tokens` cuts the call; `--strict` sends each function as OpenAI's strict mode requires
(`strict: true`, `additionalProperties: false`), which closes the objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple")


def _function(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": list(properties) if required is None else required,
        },
    }


FUNCTIONS = {
    "get_weather": _function(
        "get_weather",
        "Current weather in a city.",
        {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        ["city"],
    ),
    "calculate_area": _function(
        "calculate_area",
        "Area of a rectangle.",
        {
            "width": {"type": "number", "description": "Width in meters"},
            "height": {"type": "number", "description": "Height in meters"},
        },
    ),
    "convert_currency": _function(
        "convert_currency",
        "Convert an amount between currencies.",
        {
            "amount": {"type": "number"},
            "source": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
            "target": {"type": "string", "enum": ["USD", "EUR", "JPY", "GBP"]},
        },
    ),
    "book_table": _function(
        "book_table",
        "Book a restaurant table.",
        {
            "restaurant": {"type": "string"},
            "people": {"type": "integer", "minimum": 1, "maximum": 20},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        },
    ),
    "search_books": _function(
        "search_books",
        "Search a library catalogue.",
        {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
            "available_only": {"type": "boolean"},
        },
        ["query"],
    ),
    "set_reminder": _function(
        "set_reminder",
        "Set a reminder.",
        {
            "text": {"type": "string"},
            "minutes_from_now": {"type": "integer", "minimum": 1},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["work", "home", "health"]}, "maxItems": 3},
        },
        ["text", "minutes_from_now"],
    ),
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]
QUESTIONS = {  # function -> question templates, formatted with case values
    "get_weather": "What's the weather like in {city} right now?",
    "calculate_area": "What is the area of a room {a} meters wide and {b} meters long?",
    "convert_currency": "How much is {a} US dollars in euros?",
    "book_table": "Book a table for {n} people at Chez Nous at 19:30.",
    "search_books": "Find up to {n} available books about {topic}.",
    "set_reminder": "Remind me in {n} minutes to stretch; tag it health.",
}
TOPICS = ["whales", "volcanoes", "jazz", "chess", "bread", "comets"]


@dataclass
class Case:
    category: str
    question: str
    functions: list[dict]
    expected: str  # the function the question needs
    expected_calls: int = 1


def strict(function: dict) -> dict:
    """OpenAI's strict form of a function: closed objects, every property required."""
    parameters = {
        **function["parameters"],
        "additionalProperties": False,
        "required": list(function["parameters"]["properties"]),
    }
    return {**function, "strict": True, "parameters": parameters}


def build_cases(per_category: int = 12, strict_schemas: bool = False) -> list[Case]:
    """Deterministic cases: every function in turn, values from small fixed lists."""
    names = list(FUNCTIONS)
    functions = {name: strict(f) if strict_schemas else f for name, f in FUNCTIONS.items()}
    cases = []
    for i in range(per_category):
        name = names[i % len(names)]
        values = {
            "city": CITIES[i % len(CITIES)],
            "a": 3 + i,
            "b": 4 + 2 * i,
            "n": 2 + i % 5,
            "topic": TOPICS[i % len(TOPICS)],
        }
        question = QUESTIONS[name].format(**values)
        others = [names[(i + k) % len(names)] for k in (1, 3)]
        cases.append(Case("simple", question, [functions[name]], name))
        cases.append(Case("multiple", question, [functions[n] for n in sorted([name, *others])], name))
        cities = [CITIES[(i + k) % len(CITIES)] for k in range(2 + i % 2)]
        parallel = f"What's the weather in {', '.join(cities[:-1])} and {cities[-1]}?"
        cases.append(Case("parallel", parallel, [functions["get_weather"]], "get_weather", len(cities)))
        mixed = f"What's the weather in {cities[0]}, and what is the area of a {values['a']} by {values['b']} room?"
        mixed_functions = dict.fromkeys(["get_weather", "calculate_area", others[0]])
        cases.append(Case("parallel_multiple", mixed, [functions[n] for n in mixed_functions], "get_weather", 2))
    return cases


@dataclass
class Tally:
    requests: int = 0
    calls: int = 0
    valid_calls: int = 0
    cut_without_call: int = 0
    expected_function: int = 0
    expected_count: int = 0
    failures: list = field(default_factory=list)

    def summary(self) -> dict:
        rate = lambda n, d: round(n / d, 4) if d else None
        return {
            "requests": self.requests,
            "calls": self.calls,
            "valid_calls": self.valid_calls,
            "valid_call_rate": rate(self.valid_calls, self.calls),
            "cut_without_call": self.cut_without_call,
            "expected_function_rate": rate(self.expected_function, self.requests),
            "expected_call_count_rate": rate(self.expected_count, self.requests),
            "failures": self.failures[:5],
        }


def check_calls(case: Case, tool_calls: list, tally: Tally) -> None:
    import jsonschema

    schemas = {f["name"]: f["parameters"] for f in case.functions}
    tally.requests += 1
    tally.calls += len(tool_calls)
    for call in tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
            if call.function.name not in schemas:
                raise ValueError(f"unknown function {call.function.name!r}")
            jsonschema.validate(arguments, schemas[call.function.name])
            tally.valid_calls += 1
        except (ValueError, jsonschema.ValidationError) as err:
            tally.failures.append(
                {
                    "question": case.question,
                    "call": [call.function.name, call.function.arguments],
                    "error": str(err)[:200],
                }
            )
    if tool_calls and tool_calls[0].function.name == case.expected:
        tally.expected_function += 1
    if len(tool_calls) == case.expected_calls:
        tally.expected_count += 1


async def run(
    url: str,
    model: str | None,
    cases: list[Case],
    *,
    max_tokens: int = 160,
    concurrency: int = 8,
    temperature: float = 0.0,
    api_key: str = "unused",
) -> dict:
    import openai

    tallies = {category: Tally() for category in CATEGORIES}
    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=600
    ) as client:
        if model is None:
            model = (await client.models.list()).data[0].id

        async def one(index: int, case: Case) -> None:
            async with limit:
                response = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": case.question}],
                    tools=[{"type": "function", "function": f} for f in case.functions],
                    tool_choice="required",
                    parallel_tool_calls=case.category.startswith("parallel"),
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=index,
                )
            choice = response.choices[0]
            tally = tallies[case.category]
            calls = choice.message.tool_calls or []
            if not calls and choice.finish_reason == "length":
                tally.cut_without_call += 1
            check_calls(case, calls, tally)

        started = time.perf_counter()
        await asyncio.gather(*(one(i, case) for i, case in enumerate(cases)))
    overall = Tally()
    for tally in tallies.values():
        for name in ("requests", "calls", "valid_calls", "cut_without_call", "expected_function", "expected_count"):
            setattr(overall, name, getattr(overall, name) + getattr(tally, name))
        overall.failures += tally.failures
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seconds": round(time.perf_counter() - started, 2),
        "categories": {c: t.summary() for c, t in tallies.items() if t.requests},
        "overall": overall.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's one model")
    parser.add_argument("--per-category", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--strict", action="store_true", help="functions in OpenAI's strict form")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = asyncio.run(
        run(
            args.url,
            args.model,
            build_cases(args.per_category, args.strict),
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
        )
    )
    report["strict"] = args.strict
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    return 0 if report["overall"]["valid_call_rate"] in (1.0, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
