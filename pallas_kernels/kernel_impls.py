"""Each op's implementations by name, and the one rule that resolves "auto".

    KERNELS = {"reference": Kernel(_reference, kv_bits=True), "native": Kernel(_native, auto=("cpu",)), ...}
    KERNELS["native"](*operands, interpret=False, **op_kwargs)
    resolve(KERNELS, "auto", "cpu")  # -> "native"

An op module (`ragged_paged_attention.py`, `gdn.py`, `quantized_matmul.py`) keeps one such table
beside its op: the only place its implementation names are written. Everything else is read from
the table or from a fact on an entry: `models.ops` fills its plugin-open registries from it, the
execution plan takes `auto` and `kv_bits` from it, and tests/test_kernel_registry.py checks the
launch schema's literal choices (configs/ imports nothing of ours) against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# `auto` keys: a platform (cpu | gpu | tpu), or "interpret" for CPU with Pallas interpret mode on
INTERPRET = "interpret"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of an op and the facts its callers need."""

    fn: Callable[..., Any]
    kv_bits: bool = False  # reads KV pages held as raw bits (KVPages.view); the Pallas kernels take float pages
    per_shard: bool = False  # a Pallas kernel or custom call: under tensor parallelism, shard_map over heads
    auto: tuple[str, ...] = ()  # where "auto" picks it: platforms, or INTERPRET

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def resolve(kernels: Mapping[str, Kernel], choice: str, platform: str, interpret: Any = False) -> str:
    """The implementation name `choice` means on `platform` (cpu | gpu | tpu): itself, or for
    "auto" the entry whose `auto` names the platform (on CPU with `interpret` set: INTERPRET)."""
    if choice != "auto":
        return choice
    key = INTERPRET if platform == "cpu" and interpret else platform
    for name, kernel in kernels.items():
        if key in kernel.auto:
            return name
    raise ValueError(f"no implementation is picked by 'auto' on {key!r}; known: {list(kernels)}")


def ragged_state_args(args: tuple) -> tuple:
    """A ragged state op's positional arguments (GDN, KDA, SSD) as their Pallas kernels take them:
    the last four, cu_q_lens, state slot ids, has_initial_state and num_seqs, as int32, num_seqs
    as a [1] array."""
    import jax.numpy as jnp

    *arrays, cu_q_lens, state_slot_ids, has_initial_state, num_seqs = args
    meta = (cu_q_lens, state_slot_ids, has_initial_state, jnp.reshape(num_seqs, (-1,))[:1])
    return (*arrays, *(x.astype(jnp.int32) for x in meta))


def by_backend(tpu: Callable[..., Any], gpu: Callable[..., Any], check_interpret: bool = False) -> Callable[..., Any]:
    """An op's "pallas" entry: its GPU kernel on a GPU backend, its TPU kernel otherwise (on CPU the
    TPU kernel under Pallas interpret mode). `check_interpret`: on CPU without `interpret`, a clear
    error instead of a lowering failure."""

    def run(*args, **options):
        import jax

        backend = jax.default_backend()
        if check_interpret and backend == "cpu" and not options.get("interpret"):
            raise ValueError("impl='pallas' on CPU needs interpret=...; use impl='reference' to serve")
        return (gpu if backend == "gpu" else tpu)(*args, **options)

    return run
