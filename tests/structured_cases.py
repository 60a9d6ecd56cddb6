"""Generated structured-output test cases: JSON schemas of increasing difficulty, regexes,
choice lists and tools. Deterministic (a seeded `random.Random`), so a failing case is
reproducible by its index.

Every string is bounded (maxLength, pattern, enum) and every array has maxItems, every object
`additionalProperties: false`: a random model picks among the allowed tokens uniformly-ish, so
an unbounded string would run to max_tokens (a valid prefix, not a complete value). The mask
alone must keep every output valid; the bounds only make it finish.
"""

from __future__ import annotations

import random

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "yes", "no", "cat", "dog", "x1", "B-2"]


def _leaf(rng: random.Random, level: int) -> dict:
    kinds = ["integer", "boolean", "enum", "string", "pattern", "number", "null", "const"]
    if level >= 2:
        kinds += ["int_or_null", "format_enum_int"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.choice([-10.5, 0, 1.25, 100])
        # multipleOf bounds the fraction digits (binary-exact steps: jsonschema checks them in floats)
        return {
            "type": "number",
            "minimum": low,
            "maximum": low + rng.choice([1, 10, 1000]),
            "multipleOf": rng.choice([0.5, 0.25]),
        }
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "pattern":
        return {
            "type": "string",
            "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(ab|cd){1,3}$", "^[A-Z][a-z]{0,3}$"]),
        }
    if kind == "null":
        return {"type": "null"}
    if kind == "const":
        return {"const": rng.choice(WORDS + [7, True])}
    if kind == "int_or_null":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    return {"enum": [1, 2, 3, "many"]}


def _value(rng: random.Random, level: int, depth: int) -> dict:
    roll = rng.random()
    if depth > 0 and level >= 3 and roll < 0.25:
        return _object(rng, level, depth - 1)
    if level >= 2 and roll < 0.45:
        min_items = rng.randint(0, 2)
        return {
            "type": "array",
            "items": _leaf(rng, level),
            "minItems": min_items,
            "maxItems": min_items + rng.randint(0, 3),
        }
    if level >= 4 and roll < 0.6:
        return {"anyOf": [_leaf(rng, level), _object(rng, 1, 0) if depth else _leaf(rng, level)]}
    return _leaf(rng, level)


def _object(rng: random.Random, level: int, depth: int) -> dict:
    names = rng.sample(
        ["id", "name", "count", "tags", "ok", "kind", "score", "items", "meta", "note"],
        rng.randint(1, min(1 + level, 5 - depth)),
    )
    properties = {name: _value(rng, level, depth) for name in names}
    required = names if level < 2 else [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def json_schemas(count: int = 200, seed: int = 0) -> list[dict]:
    """`count` schemas, difficulty rising with the index: flat objects of scalars, then arrays
    with min/max items and optional fields, nested objects, and anyOf."""
    rng = random.Random(seed)
    schemas = []
    for i in range(count):
        level = 1 + (5 * i) // count  # 1..5
        schemas.append(_object(rng, level, depth=min(level - 2, 2) if level >= 3 else 0))
    return schemas


def regexes(count: int = 50, seed: int = 1) -> list[str]:
    """Regular expressions (the syntax common to Python `re` and Rust `regex`), all finite."""
    pieces = [
        r"[a-z]{1,5}",
        r"[0-9]{2,4}",
        r"(cat|dog|bird)",
        r"[A-F0-9]{2}",
        r"-",
        r"\.",
        r"(ab){1,3}",
        r"[xyz]?",
        r" ",
        r"(yes|no)",
        r"[a-zA-Z]",
        r"\d{1,3}",
        r"_",
        r"(foo|bar)?baz",
    ]
    rng = random.Random(seed)
    fixed = [
        r"\d{3}-\d{4}",
        r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)",
        r"(0|[1-9][0-9]{0,2})\.[0-9]{1,2}",
        r"#[0-9a-f]{6}",
        r"(true|false)",
        r"[A-Z]{2}[0-9]{2}",
    ]
    out = list(fixed)
    while len(out) < count:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))))
    return out[:count]


def choice_lists(count: int = 20, seed: int = 2) -> list[list[str]]:
    rng = random.Random(seed)
    extra = ["positive", "negative", "neutral", "New York", "São Paulo", "42", "a b c", "{json}", "x"]
    return [rng.sample(WORDS + extra, rng.randint(2, 6)) for _ in range(count)]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -100, "maximum": 100},
                "b": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
