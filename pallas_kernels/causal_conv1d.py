"""Causal depthwise conv1d (the short conv before the GDN recurrence), reference and ragged op.

    y_t = act(sum_j w[:, j] * x_{t-W+1+j})

A sequence's window reaches back into its conv state: the last W-1 raw inputs seen before
this step (zeros for a new request). After the step the state holds the sequence's last W-1
raw inputs; a sequence shorter than W-1 tokens shifts the old state and appends its tokens.
The ragged op is a pure slice-and-gather formulation (no per-token loop), fast enough to be the serving
path on every backend, so there is no Pallas kernel for it.
"""

import functools

import jax
import jax.numpy as jnp

_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}


def _activation(name):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {name!r}")
    return _ACTIVATIONS[name]


def causal_conv1d_reference(x, weight, initial_state, *, activation="silu"):
    """One sequence: x [T,C], weight [C,W], initial_state [W-1,C] -> (y [T,C] x.dtype, state f32)."""
    act = _activation(activation)
    t, _ = x.shape
    width = weight.shape[1]
    history = jnp.concatenate([initial_state.astype(jnp.float32), x.astype(jnp.float32)])
    w = weight.astype(jnp.float32)
    y = sum(w[:, j] * history[j : j + t] for j in range(width))
    return act(y).astype(x.dtype), history[t:]


def _gather_history(x, initial, seq_start, seq_of_row, positions):
    """Raw input at flat `positions` if inside the row's sequence, else from its initial state.

    x [T,C] f32, initial [S,W-1,C], seq_start/seq_of_row [R], positions [R,J] -> [R,J,C].
    A position p before the sequence start reads initial row (W-1) - (start - p).
    """
    width_minus_1 = initial.shape[1]
    inside = positions >= seq_start[:, None]
    from_x = x[jnp.clip(positions, 0, x.shape[0] - 1)]
    state_row = jnp.clip(width_minus_1 - (seq_start[:, None] - positions), 0, width_minus_1 - 1)
    from_state = initial[seq_of_row[:, None], state_row]
    return jnp.where(inside[..., None], from_x, from_state)


def causal_conv1d_reference_ragged(
    x, weight, conv_state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, *, activation="silu"
):
    """Ragged op in pure jnp; see `causal_conv1d` for the contract."""
    act = _activation(activation)
    t, c = x.shape
    width = weight.shape[1]
    num_seq_slots = state_slot_ids.shape[0]
    num_seqs = jnp.reshape(num_seqs, (-1,))[0]
    seq_ids = jnp.arange(num_seq_slots, dtype=jnp.int32)
    starts, ends = cu_q_lens[:-1], cu_q_lens[1:]
    seq_is_real = (seq_ids < num_seqs) & (ends > starts)

    initial = jnp.where(has_initial_state[:, None, None], conv_state[state_slot_ids].astype(jnp.float32), 0.0)
    tokens = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, tokens, side="right"), num_seq_slots - 1)
    token_valid = tokens < cu_q_lens[num_seqs]
    xf = jnp.where(token_valid[:, None], x.astype(jnp.float32), 0.0)

    # y_t = sum_j w[:, j] x_{t-W+1+j}. Inside a sequence each tap is a static shifted slice of x
    # (zeroed before the sequence start); the window of a sequence's first W-1 tokens reaches into
    # its initial state, added as a small [S, W-1, C] correction. (A gathered [T, W, C] window
    # tensor contracted by an einsum made XLA:CPU transpose it first: at T=512, C=2048, W=4 that
    # was 10.6 ms, ~15 ms in each GDN layer of a hybrid's prefill step; now 1.1 ms.)
    w = weight.astype(jnp.float32)
    xp = jnp.concatenate([jnp.zeros((width - 1, c), jnp.float32), xf])  # xp[t + W-1] = x_t
    tok_start = starts[seq][:, None]
    y = jnp.zeros((t, c), jnp.float32)
    for j in range(width):
        inside = (tokens - (width - 1) + j)[:, None] >= tok_start
        y = y + jnp.where(inside, xp[j : j + t], 0.0) * w[:, j]
    first = jnp.arange(width - 1)  # i: a sequence's i-th token
    corr = jnp.zeros((num_seq_slots, width - 1, c), jnp.float32)
    for j in range(width - 1):  # tap j of token i reads state row i + j while i + j < W-1
        row = first + j
        corr = (
            corr + jnp.where((row < width - 1)[None, :, None], initial[:, jnp.minimum(row, width - 2)], 0.0) * w[:, j]
        )
    at = jnp.where(seq_is_real[:, None] & (first[None, :] < (ends - starts)[:, None]), starts[:, None] + first, t)
    y = y.at[at].add(corr, mode="drop")
    y = jnp.where(token_valid[:, None], act(y), 0.0).astype(x.dtype)

    # new state [S,W-1,C]: the W-1 raw inputs ending at the sequence's last token
    tail_pos = ends[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]
    new_state = _gather_history(xf, initial, starts, seq_ids, tail_pos)
    # Padded and empty sequences write nowhere: an out-of-range slot index is dropped.
    target = jnp.where(seq_is_real, state_slot_ids, conv_state.shape[0])
    conv_state = conv_state.at[target].set(new_state.astype(conv_state.dtype), mode="drop")
    return y, conv_state


@functools.partial(jax.jit, static_argnames=("activation", "impl", "interpret"))
def causal_conv1d(
    x,
    weight,
    conv_state,
    cu_q_lens,
    state_slot_ids,
    has_initial_state,
    num_seqs,
    *,
    activation="silu",
    impl="reference",
    interpret=False,
):
    """Causal depthwise conv over a ragged batch, seeded from and updating conv-state slots.

    x [T,C], weight [C,W], conv_state [N,W-1,C] f32 or bf16 (read and written in its dtype), cu_q_lens [S+1] int32, state_slot_ids [S]
    int32 (slot 0 = null slot), has_initial_state [S] bool, num_seqs int32 [] or [1].
    Returns (y [T,C] in x.dtype, zero on padding tokens; conv_state). Padded or empty
    sequences leave every slot unchanged.

    impl: "reference" or "pallas"; both run the gather formulation above (it is already one
    fused XLA gather + reduction, so no Pallas kernel exists yet). `interpret` is accepted for
    signature parity and ignored.
    """
    del interpret
    if weight.shape[0] != x.shape[1] or conv_state.shape[1:] != (weight.shape[1] - 1, x.shape[1]):
        raise ValueError(f"shapes disagree: x {x.shape}, weight {weight.shape}, conv_state {conv_state.shape}")
    if weight.shape[1] < 2:
        raise ValueError("kernel width must be >= 2")
    if impl not in ("reference", "pallas"):
        raise ValueError(f"unknown impl {impl!r}")
    return causal_conv1d_reference_ragged(
        x, weight, conv_state, cu_q_lens, state_slot_ids, has_initial_state, num_seqs, activation=activation
    )
