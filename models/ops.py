"""The thin ops layer models call: picks a reference or Pallas implementation per op.

Each op's implementations are named once, in its table beside the op (`KERNELS` of
pallas_kernels/ragged_paged_attention.py, gdn.py, quantized_matmul.py; `Kernel` entries of
pallas_kernels/kernel_impls.py). Attention and GDN back-ends are selectable by name through the
registries `ATTENTION_BACKENDS` / `GDN_BACKENDS` (kinds `attention_backend` / `gdn_backend`),
filled from those tables: installed packages add their own through entry points.

`KernelOptions` is static (hashable) and travels as a jit static argument. "auto" is resolved by
`resolve_impl`, the one rule (also the execution plan's): the Pallas kernels on TPU and GPU (and
on CPU with `interpret`), on CPU "native" attention and GDN (the jnp paths with their decode /
recurrent rows in C++) and the jnp matmul. `interpret` runs Pallas kernels in interpret mode
(True, or a `pltpu.InterpretParams()` for the TPU simulator) so the whole model can run through
the kernels on CPU in tests.

With `tp` (a `models.sharding.TensorParallel`, set when parameters are split over a mesh), the
Pallas calls run under `jax.shard_map` over the model axis (heads are independent in attention
and GDN); the pure-jnp references rely on GSPMD. Without `tp` nothing changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from models.quantization import kernel_supports, qdot, qdot_pallas
from models.registry import Registry
from models.sharding import TensorParallel, unpermute_qkv
from pallas_kernels import gdn, quantized_matmul
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.causal_conv1d import causal_conv1d as _conv
from pallas_kernels.kernel_impls import resolve
from pallas_kernels.kv_write import write_kv as _write_kv

# Each op's table of built-in implementations (the names are written there only).
KERNEL_TABLES = {"attention": rpa.KERNELS, "gdn": gdn.KERNELS, "matmul": quantized_matmul.KERNELS}

# Attention and GDN back-ends by name (`attention_backend` / `gdn_backend`). An entry is
# `fn(*operands, interpret=..., **op_kwargs)`: attention `(q, kv, kv_lens, block_tables,
# cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, interpret)`, GDN `(q, k, v, g, beta,
# state, cu_q_lens, slot_ids, has_initial_state, num_seqs, *, interpret)`. Under tensor
# parallelism an entry runs per shard (shard_map over heads) if it sets `per_shard = True` (a
# plugin without the attribute: if its name starts with "pallas"); otherwise on global arrays
# (GSPMD). An attention entry with `kv_bits = True` reads KV pages held as raw bits. Plugins add
# entries as `"attention_backend.<name>"` / `"gdn_backend.<name>"` in `jaxserve.plugins`.
ATTENTION_BACKENDS: Registry = Registry("attention_backend")
GDN_BACKENDS: Registry = Registry("gdn_backend")
for _registry, _op, _table in (
    (ATTENTION_BACKENDS, rpa.ragged_paged_attention, rpa.KERNELS),
    (GDN_BACKENDS, gdn.gated_delta_rule, gdn.KERNELS),
):
    for _name, _kernel in _table.items():  # the checked, jitted op, carrying the entry's facts
        _registry.register(_name, dataclasses.replace(_kernel, fn=functools.partial(_op, impl=_name)))


def resolve_impl(which: str, choice: str, platform: str, interpret: Any = False) -> str:
    """The implementation of op `which` (attention | gdn | matmul) that `choice` means on
    `platform` (cpu | gpu | tpu): the one "auto" rule (`pallas_kernels.kernel_impls.resolve` over
    the op's table). The engine takes it from runtime/steps/execution_plan.py, which calls this."""
    return resolve(KERNEL_TABLES[which], choice, platform, interpret)


def reads_kv_bits(attention: str) -> bool:
    """Whether attention back-end `attention` wants bf16 / FP8 KV pages held as raw bits: the jnp
    paths do (XLA:CPU would convert the whole pool per write, see pallas_kernels/kv_cache.py); the
    Pallas kernels (and plugins, unless they say `kv_bits = True`) read float pages."""
    return getattr(ATTENTION_BACKENDS.get(attention), "kv_bits", False)


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    attention: str = "auto"
    gdn: str = "auto"
    interpret: Any = False
    matmul: str = "auto"  # quantized weights: "pallas" kernel or the jnp "reference" (auto: kernel off CPU)
    tp: TensorParallel | None = None  # tensor-parallel layout of the parameters and caches

    def __post_init__(self):
        for field, registry in (("attention", ATTENTION_BACKENDS), ("gdn", GDN_BACKENDS)):
            name = getattr(self, field)
            if name != "auto" and name not in registry:
                raise ValueError(f"{field}_backend must be 'auto' or one of {registry.names()}, got {name!r}")
        if self.matmul != "auto" and self.matmul not in KERNEL_TABLES["matmul"]:
            raise ValueError(
                f"matmul_backend must be 'auto' or one of {list(KERNEL_TABLES['matmul'])}, got {self.matmul!r}"
            )

    def impl(self, which: str) -> str:
        return resolve_impl(which, getattr(self, which), jax.default_backend(), self.interpret)

    @property
    def kv_bit_storage(self) -> bool:
        """Whether bf16 / FP8 KV pages should be held as raw bits (`reads_kv_bits`)."""
        return reads_kv_bits(self.impl("attention"))


def _on_mesh(fn, tp: TensorParallel, split: bool, in_specs, out_specs):
    """`fn` under shard_map: `split` -> the given head specs; else every operand replicated."""
    if not split:
        in_specs = jax.tree.map(lambda _: P(), in_specs, is_leaf=lambda x: isinstance(x, P))
        out_specs = jax.tree.map(lambda _: P(), out_specs, is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(fn, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _per_shard(name: str, backend) -> bool:
    return getattr(backend, "per_shard", name.startswith("pallas"))  # built-ins: the `Kernel` fact


def _kv_specs(kv, axis: str):
    return jax.tree.map(lambda _: P(None, axis), kv)  # k, v [P, Hkv, ps, D]; scales [P, Hkv]


def write_kv(kv, k, v, slot_mapping, opts: KernelOptions, max_seqs: int | None = None):
    """`max_seqs`: the most sequences the tokens belong to (bounds the pages gathered at once).
    On TPU whole pages are written back, no scatter into the pool (its layout cost a pool copy)."""
    write = functools.partial(_write_kv, whole_pages=opts.impl("attention") == "pallas_tpu", max_seqs=max_seqs)
    tp = opts.tp
    if tp is None or not tp.attention:
        return write(kv, k, v, slot_mapping)
    heads = P(None, tp.axis)
    return _on_mesh(write, tp, True, (_kv_specs(kv, tp.axis), heads, heads, P()), _kv_specs(kv, tp.axis))(
        kv, k, v, slot_mapping
    )


def paged_attention(
    q,
    kv,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    opts: KernelOptions,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
):
    """`sinks`: [Hq] (gpt-oss), passed to the back-end only when given (plugins need not know it)."""
    impl = opts.impl("attention")
    backend = ATTENTION_BACKENDS.get(impl)

    def attend(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, *sink):
        return backend(
            q,
            kv,
            kv_lens,
            block_tables,
            cu_q_lens,
            num_seqs,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=opts.interpret,
            **({"sinks": sink[0]} if sink else {}),
        )

    sink_args = () if sinks is None else (sinks,)
    tp = opts.tp
    if tp is not None and _per_shard(impl, backend):
        heads = P(None, tp.axis)  # q [T, Hq, D]
        in_specs = (heads, _kv_specs(kv, tp.axis), P(), P(), P(), P()) + (P(tp.axis),) * len(sink_args)
        attend = _on_mesh(attend, tp, tp.attention, in_specs, heads)
    return attend(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, *sink_args)


def gated_delta_rule(q, k, v, g, beta, state, cu_q_lens, slot_ids, has_initial_state, num_seqs, opts: KernelOptions):
    impl = opts.impl("gdn")
    backend = GDN_BACKENDS.get(impl)

    def rule(*args):
        return backend(*args, interpret=opts.interpret)

    tp = opts.tp
    if tp is not None and _per_shard(impl, backend):
        heads = P(None, tp.axis)  # q, k [T, Hk, K]; v [T, H, V]; g, beta [T, H]; state [N, H, K, V]
        rule = _on_mesh(rule, tp, tp.gdn, (heads,) * 6 + (P(),) * 4, (heads, heads))
    return rule(q, k, v, g, beta, state, cu_q_lens, slot_ids, has_initial_state, num_seqs)


def causal_conv1d(x, weight, conv_state, cu_q_lens, slot_ids, has_initial_state, num_seqs, opts: KernelOptions):
    """With `opts.tp.gdn`, x / weight / conv_state channels arrive in the per-shard [Q_i K_i V_i]
    order (models/sharding.py); y is returned in the canonical [Q | K | V] order."""
    impl = "pallas" if opts.impl("gdn").startswith("pallas") else "reference"  # one conv kernel for both
    kwargs = {"interpret": opts.interpret} if impl == "pallas" else {}

    def conv(*args):
        return _conv(*args, activation="silu", impl=impl, **kwargs)

    tp = opts.tp
    if tp is None:
        return conv(x, weight, conv_state, cu_q_lens, slot_ids, has_initial_state, num_seqs)
    if impl == "pallas":
        channels = P(None, tp.axis)  # x [T, C]
        conv = _on_mesh(
            conv,
            tp,
            tp.gdn,
            (channels, P(tp.axis, None), P(None, None, tp.axis)) + (P(),) * 4,
            (channels, P(None, None, tp.axis)),
        )
    y, conv_state = conv(x, weight, conv_state, cu_q_lens, slot_ids, has_initial_state, num_seqs)
    if tp.gdn:
        y = unpermute_qkv(y, tp.gdn_qkv_widths, tp.size)
    return y, conv_state


def linear(x, w, opts: KernelOptions | None = None, *, valid_rows=None):
    """x @ w for a float or quantized weight. Weight-only quantized weights run the Pallas kernel
    when `opts` picks it, on a single device (under tensor parallelism the jnp path, via GSPMD).
    `valid_rows`: how many leading rows of x are real tokens (`ForwardBatch.num_valid_rows`); the
    native CPU matmul skips the rest (`models.quantization.qdot`)."""
    if opts is None or opts.tp is not None or not kernel_supports(w) or opts.impl("matmul") != "pallas":
        return qdot(x, w, valid_rows)
    return qdot_pallas(x, w, interpret=opts.interpret)
