"""Frozen runtime configs for the cache and the scheduler, validated once at construction.

`configs/schema.py` validates the YAML and holds the defaults used here; the engine resolves
sizes (e.g. num_pages from a memory fraction, num_state_slots from the model) and builds these. Counts include the null
page / null slot, matching the device arrays. Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.schema import DEFAULTS
from paged_kv.cache_manager import CacheManager
from runtime.buckets import pages_for


@dataclass(frozen=True)
class CacheConfig:
    """KV pages and GDN state slots. num_state_slots == 0: a pure-attention model."""

    page_size: int = DEFAULTS.cache.page_size
    num_pages: int = 512
    num_state_slots: int = 0
    enable_prefix_caching: bool = True
    # hybrids: paged_kv.CheckpointPolicy spec. The engine always passes the launch config's
    # (default "auto"); "page" here keeps unit tests' checkpoints on every page boundary.
    checkpoint_policy: str = "page"
    num_checkpoint_slots: int | None = None  # hybrids: checkpoint budget in slots; None: shared pool

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}")
        if self.num_state_slots != 0 and self.num_state_slots < 2:
            raise ValueError(
                f"num_state_slots must be 0 (no GDN layers) or >= 2 (slot 0 is the null slot), "
                f"got {self.num_state_slots}"
            )

    def build_manager(self) -> CacheManager:
        return CacheManager(
            page_size=self.page_size,
            num_pages=self.num_pages,
            num_state_slots=self.num_state_slots,
            enable_prefix_caching=self.enable_prefix_caching,
            checkpoint_policy=self.checkpoint_policy,
            num_checkpoint_slots=self.num_checkpoint_slots,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget and policy.

    long_prefill_token_threshold: if > 0, one prefill chunk takes at most this many tokens, so
    a long prompt cannot monopolise a step's budget.
    """

    max_num_batched_tokens: int = DEFAULTS.scheduler.max_num_batched_tokens
    max_num_seqs: int = DEFAULTS.scheduler.max_num_seqs
    max_model_len: int = 2048
    policy: str = DEFAULTS.scheduler.policy
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        from runtime.scheduling.policies import POLICIES

        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token per decode step"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")


def check_pool_holds_one_sequence(num_pages: int, page_size: int, max_model_len: int) -> None:
    """vLLM's start-up rule: a KV pool that cannot hold one max_model_len sequence is refused
    (otherwise long requests would be admitted and then never fit). Page 0 is the null page."""
    usable_tokens = (num_pages - 1) * page_size
    if usable_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {usable_tokens} tokens ({num_pages - 1} usable pages x {page_size}) but one "
            f"sequence of max_model_len={max_model_len} tokens needs {pages_for(max_model_len, page_size)} pages; "
            f"give more pages (cache.num_pages / cache.memory_fraction) or lower model.max_model_len"
        )
