"""Which token boundaries of a GDN hybrid's requests get a state checkpoint, and how many may exist.

A prefix-cache hit on a hybrid is only usable up to the deepest page boundary that has both
cached KV pages and a checkpoint (the recurrent + conv state after exactly that many tokens).
A checkpoint can only be taken where a step ends for that request (the running slot is copied
after the step), so the policy decides both where prefill chunks are cut and which chunk ends
are saved. Checkpoints live in their own budget of state slots (`num_checkpoint_slots` of the
cache manager), evicted LRU, never taking a running request's slot or a KV page.

Named policies (`CheckpointPolicy.parse`):

  page         the original behaviour: every prefill chunk is cut at a page boundary and every
               chunk end is saved, plus the prompt's deepest reusable boundary; nothing in decode.
  align:<B>    vLLM's "align" mode: chunks are cut at multiples of B tokens and only those
               boundaries are saved (prefill and decode), so a hit is a multiple of B.
  auto         the default: page-aligned chunk ends (as `page`), the prompt's deepest reusable
               boundary, divergence points (the depth where a new request's cached KV reaches
               deeper than any checkpoint: the next request with that prefix hits fully), a
               request-end checkpoint refreshed every `decode_interval` tokens (default: every
               page) in decode. Chunk-end, prompt-end and decode checkpoints are *rolling*: a
               request's newest one replaces its previous one, so a running request holds at
               most one and a finished request leaves its state at most one interval before
               its end, where the next chat turn or agent step continues (an identical re-sent
               prompt therefore finds no state at its end). Divergence (and interval)
               checkpoints stay. Options: also every `interval` prefill tokens; at most
               `per_path_cap` checkpoints along one request's token path (the least recently
               used go first); `keep_prompt_end=1` keeps prompt-end checkpoints.
  ends         an approximation of SGLang's hybrid radix cache (a state per tree leaf): the
               prompt's end and the request's end (every decode page, superseded), no chunk
               ends, no divergence points; prompt-end checkpoints are kept.
  every_page   a checkpoint at every page boundary, prefill and decode (the ceiling; slow on a
               device: every prefill chunk is one page).

Options override with `name,key=value,...`, e.g. `auto,interval=2048,per_path_cap=4`.
Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICY_NAMES = ("page", "align", "auto", "ends", "every_page")
_INT_OPTIONS = ("block", "interval", "decode_interval", "per_path_cap", "keep_prompt_end")


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where checkpoints are taken. Token counts must be multiples of the page size (0: off)."""

    name: str = "auto"
    block: int = 0  # align: only multiples of `block` are cut and saved
    chunk_ends: bool = True  # cut prefill chunks at page boundaries and save every chunk end
    prompt_end: bool = True  # save the prompt's deepest reusable page boundary
    divergence: bool = True  # save where a hit's KV reaches deeper than its checkpoint
    interval: int = 0  # also save every `interval` prefill tokens
    decode: bool = True  # save in decode (and at a prompt end that is a page boundary)
    decode_interval: int = 0  # ... every N tokens (0: every page)
    per_path_cap: int = 0  # at most this many checkpoints on one request's path (0: no cap)
    keep_prompt_end: int = 0  # 1: the prompt-end checkpoint is kept (not rolling), for re-sent prompts

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"unknown checkpoint policy {self.name!r}; choose from {POLICY_NAMES}")
        for key in _INT_OPTIONS:
            if getattr(self, key) < 0:
                raise ValueError(f"checkpoint policy {self.name}: {key} must be >= 0, got {getattr(self, key)}")
        if self.name == "align" and self.block < 1:
            raise ValueError("checkpoint policy align needs a block size, e.g. align:528")

    @classmethod
    def parse(cls, spec: str | CheckpointPolicy) -> CheckpointPolicy:
        """`page`, `align:<block>`, `auto`, `ends`, `every_page`, each optionally followed by `,key=value`."""
        if isinstance(spec, CheckpointPolicy):
            return spec
        head, *options = [part.strip() for part in str(spec).split(",")]
        name, _, block = head.partition(":")
        presets = {
            "page": dict(chunk_ends=True, divergence=False, decode=False),
            "align": dict(chunk_ends=False, prompt_end=False, divergence=False),
            "auto": {},
            "ends": dict(chunk_ends=False, divergence=False),
            "every_page": {},
        }
        if name not in presets:
            raise ValueError(
                f"unknown checkpoint policy {spec!r}; choose from page, align:<block>, auto, ends, every_page"
            )
        fields = dict(presets[name], name=name)
        if block:
            if name != "align" or not block.isdigit():
                raise ValueError(f"checkpoint policy {spec!r}: only align takes a block, as align:<tokens>")
            fields["block"] = int(block)
        for option in options:
            key, _, value = option.partition("=")
            if key not in _INT_OPTIONS or not value.isdigit():
                raise ValueError(
                    f"checkpoint policy {spec!r}: bad option {option!r} (integer options: {', '.join(_INT_OPTIONS)})"
                )
            fields[key] = int(value)
        if name == "align":
            fields["decode_interval"] = fields.get("block", 0)
        if name == "every_page":
            fields["decode_interval"] = 0
        return cls(**fields)

    def check_page_size(self, page_size: int) -> None:
        for key in ("block", "interval", "decode_interval"):
            value = getattr(self, key)
            if value % page_size:
                raise ValueError(
                    f"checkpoint policy {self.name}: {key}={value} must be a multiple of the page size {page_size}"
                )

    # ---- where prefill chunks end --------------------------------------------------------------
    def _stride(self, page_size: int) -> int:
        """Every boundary that is a multiple of this is saved in prefill (0: none by stride)."""
        if self.name == "align":
            return self.block
        if self.name == "every_page":
            return page_size
        return self.interval

    def prefill_boundaries(self, start: int, end: int, num_tokens: int, page_size: int, divergence: int) -> list[int]:
        """The boundaries in (start, end] this policy saves, for a request whose known tokens
        number `num_tokens` (prompt, plus outputs when recomputing after a preemption)."""
        reusable = (num_tokens - 1) // page_size * page_size  # the deepest boundary a hit may use
        points = set()
        stride = self._stride(page_size)
        if stride:
            first = (start // stride + 1) * stride
            points.update(range(first, min(end, reusable) + 1, stride))
        if self.prompt_end:
            points.add(reusable)
        if self.divergence and divergence:
            points.add(divergence)
        return sorted(p for p in points if start < p <= end and p <= reusable and p % page_size == 0)

    def chunk_end(self, start: int, end: int, num_tokens: int, page_size: int, divergence: int = 0) -> int:
        """Where a prefill chunk proposed as [start, end) should stop: at the first saved
        boundary inside it (one checkpoint per request per step), else where proposed (the
        `page` policy: at the last page boundary, so that the chunk end can be saved)."""
        boundaries = self.prefill_boundaries(start, end, num_tokens, page_size, divergence)
        if boundaries:
            return boundaries[0]
        if self.chunk_ends and end < num_tokens and end // page_size * page_size > start:
            return end // page_size * page_size
        return end

    def saves(self, boundary: int, *, prefill: bool, num_tokens: int, page_size: int, divergence: int = 0) -> bool:
        """Whether the step ending at `boundary` tokens saves the running state. A chunk that
        ends the known tokens counts as decode (its state is the request's newest)."""
        if boundary <= 0 or boundary % page_size:
            return False
        if not prefill or boundary == num_tokens:
            if not self.decode:
                return prefill and self.chunk_ends
            return boundary % (self.decode_interval or page_size) == 0
        if self.chunk_ends:
            return True
        return boundary in self.prefill_boundaries(boundary - 1, boundary, num_tokens, page_size, divergence)

    def is_rolling(self, boundary: int, *, prefill: bool, num_tokens: int, page_size: int, divergence: int = 0) -> bool:
        """`auto`: a request's newest state (a chunk end, its prompt end, a decode boundary)
        supersedes its previous rolling checkpoint, which the deeper one on the same path
        dominates for this request's continuations; divergence and interval checkpoints stay.
        `ends`: only decode (request-end) checkpoints roll."""
        if self.name not in ("auto", "ends"):
            return False
        if not prefill or boundary == num_tokens:
            return True
        if self.name == "ends":
            return False
        reusable = (num_tokens - 1) // page_size * page_size
        kept = boundary == divergence or (self.interval and boundary % self.interval == 0)
        return not (kept or (self.keep_prompt_end and boundary == reusable))


def num_checkpoint_slots(
    budget_fraction: float, cache_bytes: int, state_bytes_per_slot: int, max_slots: int | None = None
) -> int:
    """Checkpoint slots that fit `budget_fraction` of the cache memory (KV pages + all state slots)."""
    if not 0 <= budget_fraction < 1:
        raise ValueError(f"the checkpoint budget must be a fraction in [0, 1), got {budget_fraction}")
    slots = int(budget_fraction * cache_bytes // max(state_bytes_per_slot, 1))
    return slots if max_slots is None else min(slots, max_slots)


def plan_state_slots(
    *,
    max_num_seqs: int,
    prefix_caching: bool,
    budget_fraction: float | None,
    cache_bytes: int,
    state_bytes_per_slot: int,
    page_bytes: int | None = None,
) -> tuple[int, int | None]:
    """(num_state_slots incl. the null slot, num_checkpoint_slots) for a hybrid's cache.

    One running slot per sequence; with prefix caching, checkpoint slots sized by memory:
    `budget_fraction` of `cache_bytes` (all KV pages + state slots), capped at
    CHECKPOINTS_PER_SEQ per sequence and (given `page_bytes`, one KV page's bytes) at one
    checkpoint per KV page the rest of the memory holds (a checkpoint sits on a page boundary).
    Idle conversations outnumber running sequences on a chat trace: the old cap of 2 per
    sequence reached 0.60 of the hit-rate ceiling there, the memory-sized pool ~1.0
    (benchmarks/results/host-tier/chat_trace_hits.json). `budget_fraction=None` is the original
    sizing (2 x max_num_seqs extra slots shared with running requests, no budget).
    """
    if not prefix_caching:
        return 1 + max_num_seqs, None
    if budget_fraction is None:
        return 1 + 3 * max_num_seqs, None
    cap = CHECKPOINTS_PER_SEQ * max_num_seqs
    if page_bytes:  # c <= pages = (cache - (1 + seqs + c) x slot) / page
        cap = min(
            cap,
            max(0, (cache_bytes - (1 + max_num_seqs) * state_bytes_per_slot) // (page_bytes + state_bytes_per_slot)),
        )
    checkpoints = num_checkpoint_slots(budget_fraction, cache_bytes, state_bytes_per_slot, max_slots=cap)
    return 1 + max_num_seqs + checkpoints, checkpoints


CHECKPOINTS_PER_SEQ = 32  # at most this many checkpoint slots per sequence (max_num_seqs)
