"""Expert parallelism: the routed experts split over the mesh's `model` axis, tokens moved by all-to-all.

    y = routed_experts_ep(x, weights, experts, w_gate_up, w_down, plan)   # x [T, H] -> y [T, H]

Each of the M devices holds E/M whole experts (`models/sharding.py` splits the expert index of
`experts_gate_up` / `experts_down` when `TensorParallel.expert`). Under `jax.shard_map`:

1. the (replicated) token batch is split over the model axis: device d takes tokens
   `[d*T/M, (d+1)*T/M)` and its top-k assignments;
2. dispatch: every assignment is written to a send buffer `[M, C, H]` at its destination (the
   device owning its expert) and one `all_to_all` delivers them;
3. each device runs its local experts as grouped matmuls over what it received;
4. combine: a second `all_to_all` returns the rows, each source weights and sums its tokens' k
   results, and the out-spec over the token axis all-gathers `[T, H]` for the next layer.

Padded, not ragged: `lax.ragged_all_to_all` is not implemented by XLA:CPU (jax 0.10.2:
"HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"), so the buffers have a
static capacity per destination, `C = (T/M) * min(top_k, E/M)`: the most assignments one device's
tokens can send to one device. Nothing is ever dropped (serving must be exact); the price is
padding bytes, measured in `benchmarks/expert_parallel.py` and discussed in docs/scaling.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from models.quantization import QuantizedWeight, qragged_dot


def dispatch_capacity(tokens_per_device: int, top_k: int, local_experts: int) -> int:
    """Rows one device may send to one destination: every assignment of its tokens could land
    there, but a token picks each expert at most once, so at most min(top_k, E/M) per token."""
    return tokens_per_device * min(top_k, local_experts)


def _expert_spec(w, axis: str):
    """in_spec of a per-layer expert weight [E, K, N] (float or QuantizedWeight): split on E."""
    if isinstance(w, QuantizedWeight):
        return jax.tree.map(lambda a: P(axis, *([None] * (a.ndim - 1))), w)
    return P(axis, None, None)


def expert_ffn(xs, w_gate_up, w_down, group_sizes):
    """xs [N, H] sorted by expert, group_sizes [E] -> SwiGLU expert outputs [N, H] (rows past the
    groups' total come out as zeros or garbage: callers mask or ignore them)."""
    h = qragged_dot(xs, w_gate_up, group_sizes)  # [N, 2I]
    gate, up = jnp.split(h, 2, axis=-1)
    return qragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)  # [N, H]


def _local_experts(rows, local_ids, w_gate_up, w_down, num_local: int, ffn=expert_ffn):
    """rows [N, H] with local expert ids [N] (num_local = empty slot) -> expert outputs [N, H]
    in the same order; empty slots give zeros."""
    order = jnp.argsort(local_ids)  # empty slots (id num_local) sort last and fall outside every group
    group_sizes = jnp.sum(local_ids[:, None] == jnp.arange(num_local)[None, :], axis=0).astype(jnp.int32)
    y = ffn(rows[order], w_gate_up, w_down, group_sizes)  # [N, H]
    y = jnp.where((local_ids[order] < num_local)[:, None], y, 0)
    return jnp.zeros_like(y).at[order].set(y)


def _ep_shard(x, weights, experts, w_gate_up, w_down, *, axis: str, num_devices: int, num_experts: int, ffn):
    """One device's part. x [Tl, H], weights / experts [Tl, K]; w_* hold this device's E/M experts."""
    M, E = num_devices, num_experts
    El = E // M
    Tl, H = x.shape
    K = experts.shape[1]
    C = dispatch_capacity(Tl, K, El)
    flat_expert = experts.reshape(-1)  # [Tl*K]
    dest = flat_expert // El
    order = jnp.argsort(dest)  # assignments grouped by destination device
    dest_sorted = dest[order]
    starts = jnp.searchsorted(dest_sorted, jnp.arange(M))  # first assignment of each destination
    slot = jnp.arange(Tl * K) - starts[dest_sorted]  # position within its destination's buffer, < C
    token_of = order // K
    send = jnp.zeros((M, C, H), x.dtype).at[dest_sorted, slot].set(x[token_of])
    send_ids = jnp.full((M, C), El, jnp.int32).at[dest_sorted, slot].set((flat_expert[order] % El).astype(jnp.int32))
    recv = lax.all_to_all(send, axis, 0, 0, tiled=True)  # [M, C, H]: block s came from device s
    recv_ids = lax.all_to_all(send_ids, axis, 0, 0, tiled=True)  # [M, C]
    out = _local_experts(recv.reshape(M * C, H), recv_ids.reshape(M * C), w_gate_up, w_down, El, ffn)
    back = lax.all_to_all(out.reshape(M, C, H), axis, 0, 0, tiled=True)  # block d: my rows that device d ran
    y = back[dest_sorted, slot] * weights.reshape(-1)[order][:, None].astype(x.dtype)  # [Tl*K, H]
    return jnp.zeros((Tl, H), y.dtype).at[token_of].add(y)


def routed_experts_ep(x, weights, experts, w_gate_up, w_down, plan, ffn=expert_ffn):
    """Expert-parallel routed experts. x [T, H]; weights [T, K] (routing probabilities) and experts
    [T, K] (expert ids) from the router; w_gate_up [E, H, 2I], w_down [E, I, H] split on E over
    `plan.axis`. Returns the weighted sum of each token's k expert outputs, [T, H]. `ffn(xs, w_in,
    w_down, group_sizes)`: the experts' MLP over expert-sorted rows, SwiGLU (`expert_ffn`) unless
    given (Nemotron-H's gateless relu2: models/nemotron_moe.py)."""
    M, axis = plan.size, plan.axis
    T = x.shape[0]
    E = w_gate_up.q.shape[0] if isinstance(w_gate_up, QuantizedWeight) else w_gate_up.shape[0]
    pad = -T % M  # token buckets are powers of two, but the exact-maximum bucket may not divide
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)))
    tokens = P(axis, None)

    def shard(x, weights, experts, w_gate_up, w_down):
        return _ep_shard(x, weights, experts, w_gate_up, w_down, axis=axis, num_devices=M, num_experts=E, ffn=ffn)

    run = jax.shard_map(
        shard,
        mesh=plan.mesh,
        in_specs=(tokens, tokens, tokens, _expert_spec(w_gate_up, axis), _expert_spec(w_down, axis)),
        out_specs=tokens,
        check_vma=False,
    )
    return run(x, weights, experts, w_gate_up, w_down)[:T]
