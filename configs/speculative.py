"""`speculative_config`: vLLM's interface to speculative decoding, parsed and checked once.

    speculative_config: {method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 2, prompt_lookup_max: 5}

The same mapping comes from YAML (top-level key `speculative_config`), `jaxserve serve
--speculative-config '{json}'` and `LLM(..., speculative_config={...})`. `parse_speculative_config`
turns it into a frozen `SpeculativeConfig` (None, {} or `method: null`: speculation off) or raises
ValueError naming the field. Methods that are not built yet are refused here, by name.
Imports nothing of ours (configs/ is read by all).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp", "draft_model")  # built
PLANNED_METHODS: dict[str, str] = {}
FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
)
# vLLM's fields we do not build yet, refused by name (a value equal to the default passes)
REFUSED_FIELDS = {
    "draft_tensor_parallel_size": (1, "the draft model runs unsharded (no mesh) for now"),
    "quantization": (None, "the draft model is not quantized"),
    "revision": (None, "the draft model is a local checkpoint path"),
}
MAX_SPECULATIVE_TOKENS = 16
AUTO = "auto"  # disable_by_batch_size's default: the execution plan picks it per backend


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: how drafts are made ("ngram": prompt lookup over the prompt and the output so far;
    "mtp": the checkpoint's own MTP layer, Qwen3.5 / Qwen3-Next, models/mtp.py; "draft_model": the
    checkpoint at `model`, a smaller model sharing the tokenizer, models/draft_model.py);
    num_speculative_tokens: drafted tokens per step and request (k: the step verifies k + 1 rows);
    prompt_lookup_min / _max: the n-gram lengths matched, longest first; disable_by_batch_size: no
    drafts in a step while more decoding requests than this are running (vLLM's field; None: always
    draft; "auto": the execution plan's measured crossover, `runtime.steps.execution_plan.
    spec_disable_by_batch_size`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | str | None = AUTO
    model: str | None = None

    def __post_init__(self):
        check_fields(self.__dict__)


def _int_field(raw: Mapping[str, Any], name: str, low: int, high: int) -> None:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name}: must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"speculative_config.{name}: must be in [{low}, {high}], got {value}")


def check_fields(raw: Mapping[str, Any]) -> None:
    """ValueError naming the first bad field of a full speculative_config mapping."""
    method = raw["method"]
    if method in PLANNED_METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not built yet: {PLANNED_METHODS[method]}")
    if method not in METHODS:
        known = ", ".join(METHODS + tuple(PLANNED_METHODS))
        raise ValueError(f"speculative_config.method: unknown method {method!r} (known: {known})")
    model = raw.get("model")
    if method == "draft_model" and not model:
        raise ValueError("speculative_config.model: method 'draft_model' needs the draft checkpoint's path")
    if method != "draft_model" and model is not None:
        raise ValueError(f"speculative_config.model: only for method 'draft_model', not {method!r}")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"speculative_config.model: must be a path string, got {model!r}")
    _int_field(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    _int_field(raw, "prompt_lookup_min", 1, 1024)
    _int_field(raw, "prompt_lookup_max", 1, 1024)
    if raw.get("disable_by_batch_size", AUTO) not in (None, AUTO):
        _int_field(raw, "disable_by_batch_size", 1, 1 << 20)
    if raw["prompt_lookup_min"] > raw["prompt_lookup_max"]:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({raw['prompt_lookup_min']}) exceeds "
            f"prompt_lookup_max ({raw['prompt_lookup_max']})"
        )


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None / {} / a mapping with `method: null` -> None (off); a mapping, a JSON object string or a
    `SpeculativeConfig` -> the checked config. ValueError names the field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"speculative_config: not a JSON object: {err}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config: must be a mapping, got {type(value).__name__}")
    for name, (default, why) in REFUSED_FIELDS.items():
        if name in value and value[name] != default:
            raise ValueError(f"speculative_config.{name}: not supported yet ({why})")
    value = {k: v for k, v in value.items() if k not in REFUSED_FIELDS}
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {unknown} (known: {', '.join(FIELDS)})")
    if not value or value.get("method", "ngram") is None:
        return None
    if "method" not in value:
        raise ValueError("speculative_config.method: required (ngram)")
    return SpeculativeConfig(**value)


def speculative_field(value: Any) -> dict[str, Any] | None:
    """The schema's validator: the mapping checked, kept as a plain dict (None when off)."""
    config = parse_speculative_config(value)
    return None if config is None else dict(config.__dict__)
