"""What `jaxserve plan` reports: `PlanReport` (one launch config's per-device memory and the compiled
executables' figures), its roofline estimate, the human table (`format_report`) and the JSON of
`jaxserve plan --json` (`report_json`). runtime/aot/chip_report.py fills it.
"""

from __future__ import annotations

import dataclasses

from configs.chips import ChipSpec
from paged_kv.window_pages import window_pages_per_sequence
from runtime.aot.costs import StepFigures

ROOFLINE_CONTEXT = 4096  # mean context length of the decode roofline's KV reads


class PlanError(ValueError):
    """A launch config does not fit its chip (the message names the numbers) or cannot be planned."""


@dataclasses.dataclass
class PlanReport:
    config_name: str
    model_name: str
    chip: ChipSpec
    num_devices: int
    num_processes: int
    mesh: tuple[int, int]
    param_count: int
    weight_bytes: int  # per device
    kv_bytes: int  # per device
    num_pages: int
    page_size: int
    kv_bytes_per_token: int  # per device, all layers
    state_bytes: int  # per device
    num_state_slots: int
    max_num_seqs: int
    max_model_len: int
    memory_fraction: float
    steps: list[StepFigures]
    problems: list[str]
    expert_parallel: bool = False  # MoE experts split by expert index (parallel.expert)
    latent_split: bool = (
        False  # MLA latent pools split by token over `model` (parallel.mla_latent, models/mla_split.py)
    )
    num_checkpoint_slots: int | None = None  # of num_state_slots; None: no checkpoints, or shared (no budget)
    checkpoint_budget: float | None = None  # cache.hybrid_checkpoint_budget, when checkpoints are kept
    cache_bytes: int = 0  # per device: memory_fraction x HBM - weights (KV pages + state slots)
    window: int | None = None  # window-aware paging's sliding window (num_pages: the full layers' pool)
    num_window_pages: int = 0  # its window layers' pool, with the null page

    def max_sequences(self, context: int) -> int:
        """Sequences of `context` tokens whose KV the pools hold at once (window paging: each also
        needs its window's pages in the window pool); max_num_seqs is not applied."""
        full = (self.num_pages - 1) // -(-context // self.page_size)
        if self.window is None:
            return full
        return min(full, (self.num_window_pages - 1) // window_pages_per_sequence(self.window, self.page_size, 1))

    warnings: list[str] = dataclasses.field(default_factory=list)  # fits, but wasteful (printed, in the JSON)
    kv_token_minor: bool = False  # KV pages stored [P, Hkv, D, ps] (TPU, head_dim < 128)
    host_tier: HostTierPlan | None = None  # cache.kv_offloading_size; None: off

    @property
    def checkpoint_budget_bytes(self) -> int | None:
        return None if self.checkpoint_budget is None else int(self.checkpoint_budget * self.cache_bytes)

    @property
    def state_bytes_per_slot(self) -> int:
        return self.state_bytes // self.num_state_slots if self.num_state_slots else 0

    @property
    def fits(self) -> bool:
        return not self.problems

    def raise_if_unfit(self) -> None:
        if self.problems:
            raise PlanError(f"{self.config_name}: does not fit {self.chip.name}: " + "; ".join(self.problems))

    def step(self, kind: str) -> StepFigures:
        """ "decode": the smallest token bucket holding max_num_seqs; "prefill": the largest bucket."""
        backbones = [s for s in self.steps if s.name.startswith("backbone")]
        if kind == "prefill":
            return backbones[-1]
        return next((s for s in backbones if s.tokens >= self.max_num_seqs), backbones[-1])

    def hbm_traffic(self, kind: str, context: int = ROOFLINE_CONTEXT) -> float:
        """Bytes one device must move per step: every weight once, plus for a decode step the KV of
        max_num_seqs sequences at mean `context` and their GDN states (read and written). The
        compiler's "bytes accessed" is not used: it counts each in-place cache update as a read and
        a write of the whole pool."""
        if kind != "decode":
            return float(self.weight_bytes)
        seqs = self.max_num_seqs
        state = 2 * self.state_bytes / max(self.num_state_slots, 1) * seqs
        return float(self.weight_bytes + seqs * context * self.kv_bytes_per_token + state)

    def roofline(self, kind: str, context: int = ROOFLINE_CONTEXT) -> dict[str, float]:
        """Tokens/s per chip of a full decode step (max_num_seqs sequences at mean `context`) or of a
        full prefill bucket, at the chip's HBM bandwidth and peak FLOP/s."""
        s = self.step(kind)
        tokens = min(s.tokens, self.max_num_seqs) if kind == "decode" else s.tokens
        moved = self.hbm_traffic(kind, context)
        seconds = max(moved / self.chip.hbm_bytes_per_s, s.flops / self.chip.peak_bf16_flops)
        bound = "memory" if moved / self.chip.hbm_bytes_per_s >= s.flops / self.chip.peak_bf16_flops else "compute"
        # each of the mesh's data ranks runs its own batch of `tokens` in the same step (attention DP)
        per_chip = tokens * self.mesh[0] / seconds / self.num_devices if seconds else float("inf")
        return {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s_per_chip": per_chip,
            "bound": bound,
            "bytes": moved,
            "flops": s.flops,
        }


@dataclasses.dataclass(frozen=True)
class HostTierPlan:
    """The host-memory tier (cache.kv_offloading_size, paged_kv/host_tier.py) at the real shapes:
    what one entry takes in host memory (the whole page or checkpoint over the model axis, as the
    engine's `HostStore` counts it: every attention layer's K and V and FP8 scales; every linear
    layer's conv and recurrent state) and how many of each the tier holds. Under attention DP the
    tier is split evenly, one per rank (`bytes_per_rank`)."""

    total_bytes: int  # kv_offloading_size GiB: all ranks of this engine
    data_ranks: int
    page_bytes: int
    checkpoint_bytes: int  # 0: no GDN state
    host_ram_bytes: int | None = None  # `jaxserve plan --host-ram`: the host's memory, to compare

    @property
    def bytes_per_rank(self) -> int:
        return self.total_bytes // self.data_ranks

    @property
    def pages(self) -> int:
        """Pages one rank's tier holds when it holds nothing else."""
        return self.bytes_per_rank // self.page_bytes

    @property
    def checkpoints(self) -> int:
        """GDN checkpoints one rank's tier holds when it holds nothing else."""
        return self.bytes_per_rank // self.checkpoint_bytes if self.checkpoint_bytes else 0

    def line(self) -> str:
        rank = f" per DP rank ({self.data_ranks} tiers of {gib(self.bytes_per_rank)})" if self.data_ranks > 1 else ""
        state = (
            f" or {self.checkpoints:,} GDN checkpoints x {self.checkpoint_bytes:,} B" if self.checkpoint_bytes else ""
        )
        ram = "" if self.host_ram_bytes is None else f"; host RAM {gib(self.host_ram_bytes)}"
        return (
            f"  host tier {gib(self.total_bytes)} (cache.kv_offloading_size): holds{rank} "
            f"{self.pages:,} pages x {self.page_bytes:,} B{state}{ram}"
        )

    def json(self) -> dict:
        return {
            "bytes": self.total_bytes,
            "data_ranks": self.data_ranks,
            "bytes_per_rank": self.bytes_per_rank,
            "page_bytes": self.page_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "pages": self.pages,
            "checkpoints": self.checkpoints,
            "host_ram_bytes": self.host_ram_bytes,
        }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---- report ----------------------------------------------------------------------------------------
def format_report(r: PlanReport) -> str:
    mesh = f"data {r.mesh[0]} x model {r.mesh[1]}" + (", experts split by index (EP)" if r.expert_parallel else "")
    mesh += ", MLA latent split by token" if r.latent_split else ""
    scope = " (its DP rank's own pages and slots)" if r.mesh[0] > 1 else ""
    lines = [
        f"{r.config_name}: {r.model_name} ({r.param_count / 1e9:.2f}B parameters) on {r.num_devices} x {r.chip.name} "
        f"({mesh}, {r.num_processes} process{'es' if r.num_processes > 1 else ''})",
        f"  per device{scope}: weights {gib(r.weight_bytes)}, KV {gib(r.kv_bytes)} ({r.num_pages} pages x {r.page_size} "
        f"tokens{', stored token-minor' if r.kv_token_minor else ''}, {r.kv_bytes_per_token} B/token), GDN state {gib(r.state_bytes)} ({state_slot_text(r)}); "
        f"memory_fraction {r.memory_fraction} of HBM {gib(r.chip.hbm_bytes)}",
        f"  KV pools hold {r.max_sequences(r.max_model_len)} sequences of max_model_len {r.max_model_len}"
        + (f" (window paging: window {r.window}, {r.num_window_pages} window pages)" if r.window else ""),
        f"  {'executable':<22}{'arguments':>12}{'outputs':>12}{'aliased':>12}{'temp':>12}{'peak':>12}"
        f"{'GFLOP':>12}{'GB (XLA)':>11}",
    ]
    for s in r.steps:
        lines.append(
            f"  {s.name:<22}{gib(s.argument_bytes):>12}{gib(s.output_bytes):>12}{gib(s.alias_bytes):>12}"
            f"{(gib(s.temp_bytes) if not s.analytic else 'n/a'):>12}{gib(s.peak_bytes):>12}"
            + (f"{s.flops / 1e9:>12.1f}{s.bytes_accessed / 1e9:>11.2f}" if s.flops else f"{'-':>12}{'-':>11}")
        )
    if any(s.analytic for s in r.steps):
        lines.append(
            "  (GPU: lowered for CUDA, not compiled -- jax cannot compile for CUDA without a CUDA device; "
            "memory = array sizes, no temp)"
        )
    if r.host_tier is not None:
        lines.append(r.host_tier.line())
    lines += [line for _, _, line in roofline_lines(r)]
    lines += [f"  warning: {w}" for w in r.warnings]
    lines.append("  fits: yes" if r.fits else "  DOES NOT FIT: " + "; ".join(r.problems))
    return "\n".join(lines)


def state_slot_text(r: PlanReport) -> str:
    """ "97 slots", or with a checkpoint budget "81 slots: 1 null, 32 running, 48 checkpoints within ..."."""
    if r.num_checkpoint_slots is None or r.checkpoint_budget_bytes is None:
        return f"{r.num_state_slots} slots"
    running = r.num_state_slots - r.num_checkpoint_slots - 1
    return (
        f"{r.num_state_slots} slots: 1 null, {running} running, {r.num_checkpoint_slots} checkpoints within "
        f"cache.hybrid_checkpoint_budget {r.checkpoint_budget} x {gib(r.cache_bytes)} = {gib(r.checkpoint_budget_bytes)}"
    )


def roofline_lines(r: PlanReport) -> list[tuple[str, dict[str, float], str]]:
    """(kind, `r.roofline(kind)`, the report's line) for decode and prefill, when the cost was compiled."""
    out = []
    for kind in ("decode", "prefill"):
        if r.steps and (r.step(kind).flops or r.step(kind).bytes_accessed):
            f = r.roofline(kind)
            ctx = f" at mean context {ROOFLINE_CONTEXT}" if kind == "decode" else ""
            ranks = f" per DP rank x {r.mesh[0]}" if r.mesh[0] > 1 else ""
            line = (
                f"  roofline {kind} ({f['tokens']} tokens{ranks}{ctx}, {f['bytes'] / 1e9:.1f} GB moved): "
                f"{f['seconds'] * 1e3:.2f} ms/step, "
                f"{f['tokens_per_s_per_chip']:,.0f} tokens/s per chip ({f['bound']}-bound)"
            )
            out.append((kind, f, line))
    return out


def report_json(r: PlanReport) -> dict:
    """`jaxserve plan --json`: the report's figures, per device (a DP rank's, as the table's)."""
    return {
        "config": r.config_name,
        "model": r.model_name,
        "param_count": r.param_count,
        "chip": r.chip.name,
        "num_devices": r.num_devices,
        "num_processes": r.num_processes,
        "mesh": {"data": r.mesh[0], "model": r.mesh[1]},
        "expert_parallel": r.expert_parallel,
        "mla_latent_split": r.latent_split,
        "max_num_seqs": r.max_num_seqs,
        "max_model_len": r.max_model_len,
        "memory_fraction": r.memory_fraction,
        "hbm_bytes": r.chip.hbm_bytes,
        "weight_bytes": r.weight_bytes,
        "kv_cache_bytes": r.kv_bytes,
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "num_pages": r.num_pages,
        "page_size": r.page_size,
        "window_paging": {"window": r.window, "num_window_pages": r.num_window_pages} if r.window else None,
        "max_sequences_at_max_model_len": r.max_sequences(r.max_model_len),
        "kv_token_minor": r.kv_token_minor,
        "state_bytes": r.state_bytes,
        "num_state_slots": r.num_state_slots,  # incl. the null slot and the checkpoint slots
        "state_bytes_per_slot": r.state_bytes_per_slot,
        "cache_bytes": r.cache_bytes,
        "checkpoints": {
            "num_slots": r.num_checkpoint_slots,
            "bytes": None if r.num_checkpoint_slots is None else r.num_checkpoint_slots * r.state_bytes_per_slot,
            "budget_fraction": r.checkpoint_budget,
            "budget_bytes": r.checkpoint_budget_bytes,
        },
        "executables": [
            {
                "name": s.name,
                "tokens": s.tokens,
                "argument_bytes": s.argument_bytes,
                "output_bytes": s.output_bytes,
                "alias_bytes": s.alias_bytes,
                "temp_bytes": None if s.analytic else s.temp_bytes,
                "peak_bytes": s.peak_bytes,
                "flops": s.flops,
                "bytes_accessed": s.bytes_accessed,
                "analytic": s.analytic,
            }
            for s in r.steps
        ],
        "roofline": [
            {"kind": kind, "context": ROOFLINE_CONTEXT if kind == "decode" else None, **f, "line": line.strip()}
            for kind, f, line in roofline_lines(r)
        ],
        "host_tier": None if r.host_tier is None else r.host_tier.json(),
        "fits": r.fits,
        "problems": list(r.problems),
        "warnings": list(r.warnings),
    }
