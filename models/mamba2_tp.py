"""Mamba-2 (Nemotron-H) under tensor parallelism: the SSM heads split over the mesh's `model` axis.

With M shards, shard i holds heads [i*H/M, (i+1)*H/M) and, when `n_groups % M == 0`, B / C groups
[i*G/M, (i+1)*G/M) (each head's group is then on its shard: H/G heads per group, G/M groups per
shard). in_proj's columns are canonically `[z | x | B | C | dt]`, so a plain column split would hand
shard 0 only z; they are *reordered* at load (`in_proj_permutation`) to

    [z_0 x_0 B_0 C_0 dt_0 | z_1 x_1 B_1 C_1 dt_1 | ...]

and the conv's channels (conv_w rows, conv_bias, the conv state) to `[x_i B_i C_i]` per shard
(`conv_permutation`), so every shard computes its own projection columns and its own depthwise conv
channels. A_log / dt_bias / D and the gated norm's weight split with their heads / channels (the
norm's groups, I/G channels each, never straddle shards), out_proj row-parallel, the SSM state
[slots, H, P, N] on H. `split_projection` / `split_conv_out` read the per-shard order back into
z / xBC / dt and x / B / C; with one shard they are the canonical splits. The conv and the SSD
scan run under `jax.shard_map` (one shard's heads each: the Pallas kernels see local shapes), the
rest by GSPMD.

B / C groups that do not divide by M (one group on 2 chips; 2 groups on 3) are *replicated*, as
repeat_kv_heads repeats KV heads: each group is held r = lcm(G, M) / G times (held group j is group
j // r: `held`), in in_proj's B / C columns, the conv's rows and the conv state (so a slot's conv
state is wider), and held head h still reads a copy of its own group (h // (H / (G r)) // r =
h // (H / G)); the gated norm keeps the checkpoint's G groups (GSPMD reduces across shards where a
group straddles two). SSM heads that do not divide by M keep the Mamba-2 layers whole on every
device (logged), as the GDN / KDA layers fall back. Nemotron-H's MoE
experts split on their intermediate dimension (models/sharding.py's MOE_RULES), or with expert
parallelism by expert index (models/nemotron_moe.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models.mamba2_config import Mamba2Config
from models.quantization import take_columns

log = logging.getLogger("jaxserve.sharding")

# rule names as models/sharding.py's: column / row / vector / conv / replicated
RULES = {
    "in_proj": "column",
    "in_bias": "vector",
    "conv_w": "conv",
    "conv_bias": "vector",
    "A_log": "vector",
    "dt_bias": "vector",
    "D": "vector",
    "gated_norm": "vector",
    "out_proj": "row",
    "out_bias": "replicated",
}
CONV_PARAMS = ("conv_w", "conv_bias")


def mamba_split(m: Mamba2Config, shards: int) -> bool:
    """Whether `shards` devices split the Mamba-2 heads (they divide); logs a fallback."""
    if shards == 1:
        return False
    if m.num_heads % shards == 0:
        if m.n_groups % shards:
            log.info(
                "Mamba-2 B/C groups replicated: %d groups held %d times each",
                m.n_groups,
                held_groups(m, shards) // m.n_groups,
            )
        return True
    log.warning("Mamba-2 replicated: %d SSM heads do not divide by model axis %d", m.num_heads, shards)
    return False


def held_groups(m: Mamba2Config, shards: int) -> int:
    """B / C groups held over `shards` devices that split the heads: lcm(G, shards)."""
    return math.lcm(m.n_groups, shards)


def held(m: Mamba2Config | None, tp) -> Mamba2Config | None:
    """The mixer as held under `tp` (a models.sharding.TensorParallel or None): B / C groups repeated."""
    if m is None or tp is None or not tp.mamba:
        return m
    return _held(m, tp.size)


def _held(m: Mamba2Config, shards: int) -> Mamba2Config:
    return dataclasses.replace(m, n_groups=held_groups(m, shards))


def _blocks(widths: tuple[int, ...], shards: int) -> np.ndarray:
    """Canonical index at each position of the per-shard order of consecutive parts `widths`."""
    offsets = np.cumsum((0, *widths))
    return np.concatenate(
        [
            offset + np.arange(i * (w // shards), (i + 1) * (w // shards))
            for i in range(shards)
            for offset, w in zip(offsets, widths)
        ]
    )


def conv_permutation(m: Mamba2Config, shards: int) -> np.ndarray:
    GN = m.n_groups * m.state_size
    return _blocks((m.intermediate_size, GN, GN), shards)


def in_proj_permutation(m: Mamba2Config, shards: int) -> np.ndarray:
    GN, I = m.n_groups * m.state_size, m.intermediate_size
    return _blocks((I, I, GN, GN, m.num_heads), shards)


def _sources(m: Mamba2Config, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint index of every held in_proj column and conv channel, in the per-shard order."""
    h = _held(m, shards)
    I, N, GN, r = m.intermediate_size, m.state_size, m.n_groups * m.state_size, h.n_groups // m.n_groups
    bc = np.arange(h.n_groups * N)
    bc = (bc // N // r) * N + bc % N  # held B (or C) column -> the checkpoint's
    conv = np.concatenate([np.arange(I), I + bc, I + GN + bc])
    cols = np.concatenate([np.arange(I), I + conv, I + m.conv_dim + np.arange(m.num_heads)])
    return cols[in_proj_permutation(h, shards)], conv[conv_permutation(h, shards)]


def reorder_params(params: dict, m: Mamba2Config, shards: int) -> dict:
    """in_proj (and its bias) columns, conv_w rows and conv_bias: B / C groups repeated where held
    so, then in the per-shard order."""
    cols, conv = _sources(m, shards)
    groups = []
    for g in params["groups"]:
        if "in_proj" in g:
            g = {**g, "in_proj": take_columns(g["in_proj"], cols), "conv_w": g["conv_w"][:, conv, :]}
            g.update({k: g[k][..., v] for k, v in (("in_bias", cols), ("conv_bias", conv)) if k in g})
        groups.append(g)
    return {**params, "groups": tuple(groups)}


def split_projection(proj, m: Mamba2Config, shards: int):
    """in_proj's output [T, in_proj_size] in the per-shard order -> (z [T, I] canonical, xBC [T, conv_dim]
    in the per-shard conv order, dt [T, H] canonical)."""
    T, I = proj.shape[0], m.intermediate_size
    blocks = proj.reshape(T, shards, -1)
    z, xbc, dt = jnp.split(blocks, [I // shards, (I + m.conv_dim) // shards], axis=-1)
    return z.reshape(T, I), xbc.reshape(T, m.conv_dim), dt.reshape(T, m.num_heads)


def split_conv_out(xbc, m: Mamba2Config, shards: int):
    """The conv's output [T, conv_dim] in the per-shard order -> x [T, H, P], B, C [T, G, N]."""
    T, I, GN = xbc.shape[0], m.intermediate_size, m.n_groups * m.state_size
    x, b, c = jnp.split(xbc.reshape(T, shards, -1), [I // shards, (I + GN) // shards], axis=-1)
    return (
        x.reshape(T, m.num_heads, m.head_dim),
        b.reshape(T, m.n_groups, m.state_size),
        c.reshape(T, m.n_groups, m.state_size),
    )


def on_shards(fn, tp, in_specs, out_specs):
    """`fn` under shard_map over `tp`'s model axis (each shard's heads); `fn` itself without `tp`."""
    if tp is None:
        return fn
    return jax.shard_map(fn, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def conv_specs(axis: str):
    """(in_specs, out_specs) of the ragged conv (x, weight, conv_state, cu, slots, has_initial, num_seqs)."""
    return (P(None, axis), P(axis, None), P(None, None, axis), P(), P(), P(), P()), (P(None, axis), P(None, None, axis))


def ssd_specs(axis: str):
    """(in_specs, out_specs) of pallas_kernels.ssd.ssd's (x, dt, A, B, C, D, dt_bias, state, cu, slots,
    has_initial, num_seqs): heads and groups on the model axis."""
    heads = P(None, axis)
    vector = P(axis)
    ins = (heads, heads, vector, heads, heads, vector, vector, P(None, axis), P(), P(), P(), P())
    return ins, (heads, P(None, axis))
