"""The Mamba-2 mixer layer (Nemotron-H's `NemotronHMamba2Mixer`) over a ragged batch with state slots.

    in_proj -> [gate z | xBC | dt]; xBC -> causal depthwise conv (+ bias) -> silu -> [x | B | C];
    y = SSD scan(x, dt, A = -exp(A_log), B, C) + D x; y -> RMSNorm(y * silu(z)) per group; out_proj

The conv state ([W-1, conv_dim] raw inputs) and the SSM state ([H, P, N] fp32) live in state slots
exactly as a GDN layer's do (models/transformer.py's `gdn_layer`): a sequence starts from its slot
when `has_initial_state` (a later prefill chunk, a decode step, a prefix-cache checkpoint) and from
zeros otherwise, and leaves its state in its slot. The scan is pallas_kernels/ssd.py's ragged op;
its implementation follows the GDN back-end choice where the SSD op has one of that name, "auto"
otherwise (the per-token loop on CPU, the Pallas kernels on TPU / GPU and with `interpret`).
Under tensor parallelism (`opts.tp.mamba`) the heads are split: in_proj's columns and the conv's
channels arrive in a per-shard order, and the conv and the scan run per shard (models/mamba2_tp.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from models import gdn_replay, hybrid_replay, mamba2_tp, ops
from models.batch import ForwardBatch
from models.config import ModelConfig
from pallas_kernels import ssd
from pallas_kernels.causal_conv1d import causal_conv1d
from pallas_kernels.kernel_impls import resolve


def ssd_impl(opts: ops.KernelOptions) -> str:
    """The SSD implementation `opts` asks for: its GDN back-end's name when the SSD table has it."""
    choice = opts.gdn if opts.gdn in ssd.KERNELS else "auto"
    return resolve(ssd.KERNELS, choice, jax.default_backend(), opts.interpret)


def gated_rms_norm(y, z, w, n_groups: int, eps: float):
    """HF's NemotronHRMSNormGated: (y * silu(z)) normed over each of `n_groups` channel groups, then
    times w. y, z [T, I] -> [T, I] in y's dtype."""
    T, I = y.shape
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    h = h.reshape(T, n_groups, I // n_groups)
    h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return w * h.reshape(T, I).astype(y.dtype)


def mamba2_layer(p, x, conv_state, ssm_state, batch: ForwardBatch, slot_offset, cfg: ModelConfig, opts):
    """x [T, hidden] -> (out [T, hidden], conv_state, ssm_state); the states are this layer's slot
    pools ([slots, W-1, conv_dim], [slots, H, P, N]), `slot_offset` its layer group's first slot. A
    verify pass (`batch.spec_rows`) commits no state for drafting sequences and appends their
    stashed per-token inputs (models/hybrid_replay.py)."""
    m = cfg.mamba
    T, G, I = x.shape[0], m.n_groups, m.intermediate_size
    slots, rows = batch.state_slot_ids + slot_offset, batch.num_valid_rows
    proj = ops.linear(x, p["in_proj"], opts, valid_rows=rows)  # [T, I + conv_dim + H]
    if "in_bias" in p:
        proj = proj + p["in_bias"]
    tp = opts.tp if opts.tp is not None and opts.tp.mamba else None
    shards, mh = 1 if tp is None else tp.size, mamba2_tp.held(m, tp)  # mh: B / C groups as held
    z, xbc, dt = mamba2_tp.split_projection(proj, mh, shards)
    conv = mamba2_tp.on_shards(
        lambda *args: causal_conv1d(*args, activation=None), tp, *mamba2_tp.conv_specs(tp and tp.axis)
    )
    raw, verify = xbc, batch.spec_rows is not None  # a verify pass: no state for drafts (models/hybrid_replay.py)
    if verify:
        xbc, conv_state = gdn_replay.verify_state(conv, (raw, p["conv_w"]), conv_state, batch, slots)
    else:
        xbc, conv_state = conv(
            raw, p["conv_w"], conv_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs
        )
    if "conv_bias" in p:
        xbc = xbc + p["conv_bias"]
    xs, b, c = mamba2_tp.split_conv_out(jax.nn.silu(xbc), mh, shards)
    scan = mamba2_tp.on_shards(
        lambda *args: ssd.ssd(*args, impl=ssd_impl(opts), interpret=opts.interpret, dt_limit=m.dt_limit),
        tp,
        *mamba2_tp.ssd_specs(tp and tp.axis),
    )
    a = -jnp.exp(p["A_log"].astype(jnp.float32))
    tokens = (xs, dt, a, b, c, p["D"], p["dt_bias"])
    stash = None
    if verify:
        y, ssm_state = gdn_replay.verify_state(scan, tokens, ssm_state, batch, slots)
        stash = hybrid_replay.ssm_stash_rows(batch, raw, xs, ssd.ssd_dt(dt, p["dt_bias"], m.dt_limit), b, a)
    else:
        y, ssm_state = scan(
            *tokens, ssm_state, batch.cu_q_lens, slots, batch.has_initial_state, batch.num_seqs
        )  # fmt: skip
    y = gated_rms_norm(y.reshape(T, I), z, p["gated_norm"], G, m.norm_eps)
    out = ops.linear(y.astype(x.dtype), p["out_proj"], opts, valid_rows=rows)
    if "out_bias" in p:
        out = out + p["out_bias"]
    return (out, conv_state, ssm_state) if stash is None else (out, conv_state, ssm_state, stash)
