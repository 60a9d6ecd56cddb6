"""The thin ops layer models call: picks a reference or Pallas implementation per op.

`KernelOptions` is static (hashable) and travels as a jit static argument. `"auto"` picks the
Pallas kernels on TPU and GPU and the pure-jnp references on CPU; `interpret` runs Pallas
kernels in interpret mode (True, or a `pltpu.InterpretParams()` for the TPU simulator) so the
whole model can run through the kernels on CPU in tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_kernels.causal_conv1d import causal_conv1d as _conv
from pallas_kernels.gdn import gated_delta_rule as _gdr
from pallas_kernels.kv_write import write_kv as _write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

BACKENDS = ("auto", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    attention: str = "auto"
    gdn: str = "auto"
    interpret: Any = False

    def __post_init__(self):
        for field in ("attention", "gdn"):
            if getattr(self, field) not in BACKENDS:
                raise ValueError(f"{field}_backend must be one of {BACKENDS}, got {getattr(self, field)!r}")

    def impl(self, which: str) -> str:
        choice = getattr(self, which)
        if choice != "auto":
            return choice
        return "reference" if jax.default_backend() == "cpu" and not self.interpret else "pallas"


def write_kv(kv, k, v, slot_mapping, opts: KernelOptions):
    return _write_kv(kv, k, v, slot_mapping)


def paged_attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, opts: KernelOptions, *, sm_scale,
                    sliding_window=None, soft_cap=None):
    impl = opts.impl("attention")
    kwargs = {"interpret": opts.interpret} if impl == "pallas" else {}
    return ragged_paged_attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap, impl=impl, **kwargs)


def gated_delta_rule(q, k, v, g, beta, state, cu_q_lens, slot_ids, has_initial_state, num_seqs, opts: KernelOptions):
    impl = opts.impl("gdn")
    kwargs = {"interpret": opts.interpret} if impl == "pallas" else {}
    return _gdr(q, k, v, g, beta, state, cu_q_lens, slot_ids, has_initial_state, num_seqs, impl=impl, **kwargs)


def causal_conv1d(x, weight, conv_state, cu_q_lens, slot_ids, has_initial_state, num_seqs, opts: KernelOptions):
    impl = opts.impl("gdn")
    kwargs = {"interpret": opts.interpret} if impl == "pallas" else {}
    return _conv(x, weight, conv_state, cu_q_lens, slot_ids, has_initial_state, num_seqs, activation="silu",
                 impl=impl, **kwargs)
