"""Per-row sampling arrays that cross `jit` into the sampler, and their host-side builder.

`SamplingMetadata` is a pytree of `[S]` arrays (one row per sampled sequence, S padded to a
sequence bucket) plus, only when some request in the batch uses a penalty, padded token-id
matrices for the penalties. Their widths are powers of two, so the set of executables stays
small; when no request uses penalties they are zero-width and the sampler skips that work
entirely (the shapes, hence the executable, differ).

With the device-resident request table the per-row parameters (temperature ... seeds) are not
sent: they live in the request's table row from its placement (runtime/steps/table_host.py), the
metadata carries None for them (`from_params(..., row_params=False)`) and the sampler fills them
from the table (`runtime.steps.table_device.row_sampling`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from runtime.buckets import PENALTY_WIDTH_MIN, banned_width  # noqa: F401 - PENALTY_WIDTH_MIN re-exported
from runtime.buckets import penalty_width as pow2_bucket  # the width rule lives in runtime/buckets.py
from runtime.steps.table_host import ROW_PARAMS  # the fields the request table can hold instead
from runtime.types import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler needs per row. Padded rows are greedy with neutral penalties.

    temperature [S] f32 (0 = greedy), top_k [S] i32 (0 = off), top_p [S] f32 (1 = off),
    min_p [S] f32 (0 = off), presence_penalty / frequency_penalty [S] f32 (0 = off),
    repetition_penalty [S] f32 (1 = off), seeds [S] u32, steps [S] i32 (index of the token being
    generated: the row's random key is `fold_in(key(seed), step)`), output_ids [S, L] i32 and
    prompt_ids [S, Lp] i32 padded with -1 (L or Lp may be 0). temperature ... seeds are None
    where the request table holds them (`has_row_params`).
    """

    temperature: jax.Array | None
    top_k: jax.Array | None
    top_p: jax.Array | None
    min_p: jax.Array | None
    presence_penalty: jax.Array | None
    frequency_penalty: jax.Array | None
    repetition_penalty: jax.Array | None
    seeds: jax.Array | None
    steps: jax.Array
    output_ids: jax.Array
    prompt_ids: jax.Array
    banned_ids: jax.Array | None = None  # [S, B] i32, -1 padded: tokens that must not be sampled
    # OpenAI logit_bias: [S, W] i32 token ids (-1 padded) and [S, W] f32 biases; W = 0 when no
    # row has one, else a power of two >= 16 (at most 512 for 300 entries).
    logit_bias_ids: jax.Array | None = None
    logit_bias_values: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.steps.shape[0]

    @property
    def has_row_params(self) -> bool:
        """Static: whether the per-row parameters are here (else the request table holds them)."""
        return self.temperature is not None

    @property
    def num_banned(self) -> int:
        return 0 if self.banned_ids is None else self.banned_ids.shape[1]

    @property
    def num_logit_bias(self) -> int:
        return 0 if self.logit_bias_ids is None else self.logit_bias_ids.shape[1]

    @property
    def has_penalties(self) -> bool:
        """Static (shape-derived): whether this batch carries any penalty token ids."""
        return self.output_ids.shape[1] > 0 or self.prompt_ids.shape[1] > 0

    def with_widths(self, output: int, prompt: int, banned: int, bias: int) -> SamplingMetadata:
        """The same rows with every token-id matrix padded (-1; bias values 0) to the given widths,
        which must be at least the current ones: padding changes no sample, only the shapes (the
        bounded "full" sampler variant of runtime/steps/executables.py)."""
        rows = self.num_rows

        def pad(matrix, width, fill, name):
            matrix = np.zeros((rows, 0), np.int32) if matrix is None else np.asarray(matrix)
            if matrix.shape[1] > width:
                raise ValueError(f"{name} width {matrix.shape[1]} exceeds {width}")
            return np.pad(matrix, ((0, 0), (0, width - matrix.shape[1])), constant_values=fill)

        values = self.logit_bias_values if self.logit_bias_values is not None else np.zeros((rows, 0), np.float32)
        return dataclasses.replace(
            self,
            output_ids=pad(self.output_ids, output, -1, "output_ids"),
            prompt_ids=pad(self.prompt_ids, prompt, -1, "prompt_ids"),
            banned_ids=pad(self.banned_ids, banned, -1, "banned_ids"),
            logit_bias_ids=pad(self.logit_bias_ids, bias, -1, "logit_bias_ids"),
            logit_bias_values=pad(values, bias, 0.0, "logit_bias_values").astype(np.float32),
        )

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        steps: Sequence[int],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        pad_to: int,
        *,
        rng: np.random.Generator | None = None,
        banned_ids: Sequence[Sequence[int]] | None = None,
        row_params: bool = True,
    ) -> SamplingMetadata:
        """Build host (numpy) arrays for `len(params_list)` real rows padded to `pad_to` rows.

        steps[i]: tokens already generated by request i (its output length). output_ids[i] /
        prompt_ids[i]: its generated / prompt token ids, read only when a penalty needs them.
        A request without a seed gets a fresh random one (reproducible only with a seed);
        seeds are taken modulo 2**32. `rng` draws those fresh seeds (default: OS entropy).
        banned_ids[i]: token ids row i must not sample (e.g. EOS and stop tokens until
        `min_tokens`); the matrix is zero-width when no row bans anything. `row_params=False`:
        temperature ... seeds are None (the request table holds them; no seed is drawn here).
        """
        n = len(params_list)
        if not (len(steps) == len(output_ids) == len(prompt_ids) == n):
            raise ValueError(
                f"params_list, steps, output_ids, prompt_ids must have equal lengths, got "
                f"{n}, {len(steps)}, {len(output_ids)}, {len(prompt_ids)}"
            )
        if pad_to < n:
            raise ValueError(f"pad_to ({pad_to}) is smaller than the number of requests ({n})")
        rng = rng if rng is not None else np.random.default_rng()

        def column(values, fill, dtype):
            out = np.full((pad_to,), fill, dtype=dtype)
            out[:n] = values
            return out

        uses_repetition = [p.repetition_penalty != 1.0 for p in params_list]
        uses_any_penalty = [
            rep or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p, rep in zip(params_list, uses_repetition)
        ]
        out_width = pow2_bucket(max((len(ids) for ids, use in zip(output_ids, uses_any_penalty) if use), default=0))
        prompt_width = pow2_bucket(max((len(ids) for ids, use in zip(prompt_ids, uses_repetition) if use), default=0))
        out_matrix = _padded_id_matrix(output_ids, uses_any_penalty, pad_to, out_width)
        bias_width = pow2_bucket(max((len(p.logit_bias) for p in params_list), default=0))
        bias_ids = np.full((pad_to, bias_width), -1, np.int32)
        bias_values = np.zeros((pad_to, bias_width), np.float32)
        for i, p in enumerate(params_list):
            for j, (token, bias) in enumerate(p.logit_bias):
                bias_ids[i, j], bias_values[i, j] = token, bias
        prompt_matrix = _padded_id_matrix(prompt_ids, uses_repetition, pad_to, prompt_width)
        per_row = dict.fromkeys(ROW_PARAMS)
        if row_params:
            fresh_seeds = rng.integers(0, 2**32, size=n, dtype=np.uint64)
            seeds = [
                (p.seed % 2**32) if p.seed is not None else int(fresh) for p, fresh in zip(params_list, fresh_seeds)
            ]
            per_row = dict(
                temperature=column([p.temperature for p in params_list], 0.0, np.float32),
                top_k=column([p.top_k for p in params_list], 0, np.int32),
                top_p=column([p.top_p for p in params_list], 1.0, np.float32),
                min_p=column([p.min_p for p in params_list], 0.0, np.float32),
                presence_penalty=column([p.presence_penalty for p in params_list], 0.0, np.float32),
                frequency_penalty=column([p.frequency_penalty for p in params_list], 0.0, np.float32),
                repetition_penalty=column([p.repetition_penalty for p in params_list], 1.0, np.float32),
                seeds=column(seeds, 0, np.uint32),
            )

        return cls(
            **per_row,
            steps=column(list(steps), 0, np.int32),
            output_ids=out_matrix,
            prompt_ids=prompt_matrix,
            banned_ids=_padded_id_matrix(
                banned_ids or [[]] * n,
                [True] * n,
                pad_to,
                banned_width(max((len(b) for b in banned_ids or []), default=0)),
            ),
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
        )


def _padded_id_matrix(rows: Sequence[Sequence[int]], used: Sequence[bool], num_rows: int, width: int) -> np.ndarray:
    # [num_rows, width] int32, -1 padded; rows whose request does not need them stay -1.
    matrix = np.full((num_rows, width), -1, dtype=np.int32)
    for i, (ids, use) in enumerate(zip(rows, used)):
        if use and len(ids):
            matrix[i, : len(ids)] = ids
    return matrix


jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=[f.name for f in dataclasses.fields(SamplingMetadata)],
    meta_fields=[],
)


BANNED_WIDTH = 2 * MAX_STOP_TOKEN_IDS  # banned ids of the full sampler: stop token ids + EOS ids


@dataclasses.dataclass(frozen=True)
class FullWidths:
    """Fixed widths of the full sampler's feature matrices (one executable per sequence bucket)."""

    output_ids: int
    prompt_ids: int
    banned_ids: int = BANNED_WIDTH
    logit_bias: int = pow2_bucket(MAX_LOGIT_BIAS)

    @classmethod
    def for_model_len(cls, max_model_len: int) -> FullWidths:
        width = pow2_bucket(max_model_len)
        return cls(output_ids=width, prompt_ids=width)
