"""The rules config values keep, each written once.

The launch schema (configs/schema.py) checks a YAML with these functions, and the engine's frozen
configs (runtime/engine_config.py) check a direct construction (tests, benchmarks, `LLM(...)`) with
the same ones, so a rule and its message cannot drift apart. A rule returns the value (normalized,
for `normalize_peer`) or raises ValueError with a message that leaves the field's name to the
caller: the schema prefixes the field path (`cache.page_size: must be ...`), a dataclass the field
name (`check_fields`: `page_size: must be ...`). A rule between two fields names both. Names
checked against the registries (back-ends, policies) are `configs.schema.check_name`'s.
Imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Rule = Callable[[Any], Any]

DTYPES = ("bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # auto: the model dtype
STATE_DTYPES = ("float32", "bfloat16")  # recurrent (GDN) state slots; vLLM's mamba_ssm_cache_dtype
LAYER_LOOPS = ("auto", "scan", "unroll")
ROLES = ("prefill", "decode", "both")
MLA_LATENT = ("replicated", "split", "auto")  # MLA latent pools under TP (models/mla_split.py)
PULL_FAILURE_ACTIONS = ("recompute", "error")
MAX_PAGE_SIZE = 1024


def one_of(choices: tuple[str, ...]) -> Rule:
    def rule(value):
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
        return value

    return rule


def at_least(minimum: int) -> Rule:
    def rule(value):
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return rule


def optional(rule: Rule) -> Rule:
    """`rule` for a value that may also be None (None: resolved later)."""
    return lambda value: value if value is None else rule(value)


def positive(value):
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def page_size(value: int) -> int:
    if value < 1 or value & (value - 1) or value > MAX_PAGE_SIZE:
        raise ValueError(f"must be a power of two in [1, {MAX_PAGE_SIZE}], got {value}")
    return value


def num_pages(value: int) -> int:
    if value < 2:
        raise ValueError(f"must be >= 2 (page 0 is the null page), got {value}")
    return value


def num_state_slots(value: int) -> int:
    if value != 0 and value < 2:
        raise ValueError(f"must be 0 (no GDN layers) or >= 2 (slot 0 is the null slot), got {value}")
    return value


def max_model_len(value: int) -> int:
    if value < 2:
        raise ValueError(f"must be >= 2 (a prompt token and a generated one), got {value}")
    return value


def memory_fraction(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")
    return value


def checkpoint_budget(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {value}")
    return value


def mesh_shape(value: tuple[int, int]) -> tuple[int, int]:
    if len(value) != 2 or min(value) < 1:
        raise ValueError(f"must be (data, model) with both >= 1, got {value}")
    return value


def normalize_peer(peer: str) -> str:
    """ "host:port" (an http:// URL's netloc is accepted) -> "host:port" lowercased."""
    text = str(peer).strip().lower().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host or "@" in host:
        raise ValueError(f"must be host:port, got {peer!r}")
    return f"{host}:{int(port)}"


def secret_strength(value):
    """A shared secret (pydantic `SecretStr`) long enough to be worth having."""
    if len(value.get_secret_value().strip()) < 16:
        raise ValueError(
            "must be at least 16 characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return value


def batch_budget(max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """Every running sequence needs a token of the step budget when all of them decode."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
            "so a full decode step fits"
        )


def check_fields(config: Any, rules: Mapping[str, Rule]) -> None:
    """Apply `rules` (field name -> rule) to a dataclass; the ValueError names the field."""
    for name, rule in rules.items():
        try:
            rule(getattr(config, name))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
