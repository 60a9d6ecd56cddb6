"""The transfer descriptor: what a prefill instance holds for one request, as JSON.

    {"version": 1, "rule": "prefill_n_minus_1" | "prefill_n_adopt", "num_tokens": K,
     "token_digest": sha256 of the K ids, "first_token": id (prefill_n_adopt only),
     "page_size": 16, "num_pages": n (padded), "kv_dtype": "float32", "kv_wire": "values" | "bits",
     "state_dtype": "float32" | "bfloat16" (GDN state slots; absent: float32),
     "model": {layer_types, num_kv_heads, head_dim, conv, rec, mla, num_groups, vocab_size, fingerprint},
     "window": {"first_block": f, "num_pages": nw} (window-aware paging on the prefill side only),
     "mtp": {"hidden_dtype": ...} (the MTP layer's rows and carry follow the arrays: spec_layout.py),
     "arrays": [[name, shape, wire dtype], ...]}          # the pulled arrays, in this order

Arrays: per attention position j of the layer pattern, `kv{j}.k` / `kv{j}.v` `[G*n, Hkv, ps, D]`
(the request's pages of every layer group g, g-major, padded with the null page; with `window`, a
sliding-window position's pages are blocks f .. f+nw-1 only: runtime/kv_transfer/window_layout.py) and for FP8
`kv{j}.k_scale` / `kv{j}.v_scale` `[G*n, Hkv]`; per MLA position (DeepSeek-V3, Kimi Linear) `kv{j}.c`
`[G*n, ps, kv_lora_rank + qk_rope_head_dim]` and for FP8 `kv{j}.c_scale` `[G*n]` (the model
signature then carries `mla`: runtime/kv_transfer/latent_layout.py); per GDN (Mamba-2) position j, `conv{j}` `[G, W-1, C]`
and `rec{j}` `[G, H, K, V]` (`[G, H, P, N]`) (the request's slot) in the prefill side's `state_dtype`,
bfloat16 as raw bits; the decode side casts them to its own state dtype; an MLP-only position has none.
The decode side checks every field
against its own model and the request's prompt before it allocates or pulls a byte
(`check_descriptor`): types, the dtype allow-list, page size and page count consistent with the
token count, the model signature including the checkpoint's fingerprint (models/fingerprint.py),
and the array list. Plain Python.
"""

from __future__ import annotations

import hashlib
import math
import struct

from models.mamba2_config import recurrent_state_shapes
from runtime.kv_transfer.base import TransferError

DESCRIPTOR_VERSION = 1
# The last-token rules (docs/disaggregation.md). N-1: the prefill side ships the KV / state of
# the first N-1 prompt tokens; the decode side feeds token N itself, so its first sampled token
# comes from its own forward pass over the true last token. Adopt (GDN hybrids with FP8 KV):
# the prefill side ships the state after all N tokens plus its first (greedy) sampled token; the
# decode side emits that token as its first output and feeds it in its first step.
LAST_TOKEN_RULE = "prefill_n_minus_1"
ADOPT_RULE = "prefill_n_adopt"
LAST_TOKEN_RULES = {LAST_TOKEN_RULE: 1, ADOPT_RULE: 0}  # rule -> prompt tokens not shipped
# Logical KV dtypes a descriptor may name (jnp.dtype(name).name of the cache dtypes we build).
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
STATE_DTYPES = ("float32", "bfloat16")  # configs.rules.STATE_DTYPES
MAX_PAGE_SIZE = 4096
DESCRIPTOR_KEYS = frozenset(
    {
        "version",
        "rule",
        "num_tokens",
        "token_digest",
        "first_token",
        "page_size",
        "num_pages",
        "kv_dtype",
        "kv_wire",
        "state_dtype",
        "model",
        "arrays",
        "window",
        "mtp",
    }
)


def token_digest(token_ids) -> str:
    ids = [int(t) for t in token_ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def model_signature(cfg, num_groups: int, fingerprint: str = "") -> dict:
    """What both sides must agree on: the checkpoint (architecture and identity), not the
    serving layout."""
    sig = {
        "layer_types": list(cfg.layer_types[: cfg.layer_period()]),
        "num_groups": num_groups,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "fingerprint": fingerprint,
    }
    if cfg.mla is not None:  # MLA latent rows: how the row's channels split (latent_layout.py)
        m = cfg.mla
        sig["mla"] = {"kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim, "rope": bool(m.rope)}
    if cfg.is_hybrid:  # one slot's states per recurrent layer (GDN, KDA or Mamba-2)
        conv, rec = recurrent_state_shapes(cfg)
        sig["conv"], sig["rec"] = list(conv), list(rec)
    return sig


def build_descriptor(
    *,
    prompt_token_ids,
    num_tokens: int,
    rule: str = LAST_TOKEN_RULE,
    page_size: int,
    num_pages: int,
    kv_dtype: str,
    kv_wire: str,
    signature: dict,
    arrays: list[list],
    state_dtype: str = "float32",
) -> dict:
    return {
        "version": DESCRIPTOR_VERSION,
        "rule": rule,
        "num_tokens": num_tokens,
        "token_digest": token_digest(prompt_token_ids[:num_tokens]),
        "page_size": page_size,
        "num_pages": num_pages,
        "kv_dtype": kv_dtype,
        "kv_wire": kv_wire,
        "state_dtype": state_dtype,
        "model": signature,
        "arrays": arrays,
    }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_descriptor(desc, *, prompt_token_ids, signature: dict) -> int:
    """The number of prompt tokens `desc` brings, or TransferError saying why it is unusable.
    Every field is checked here, before anything is allocated or pulled; the array list is then
    compared with what this model derives (layout.expected_arrays)."""
    if not isinstance(desc, dict):
        raise TransferError("descriptor must be a JSON object")
    unknown = set(desc) - DESCRIPTOR_KEYS
    if unknown:
        raise TransferError(f"descriptor has unknown fields {sorted(unknown)}")
    if desc.get("version") != DESCRIPTOR_VERSION or not _is_int(desc.get("version")):
        raise TransferError(f"descriptor version {desc.get('version')!r}, this instance reads {DESCRIPTOR_VERSION}")
    rule = desc.get("rule")
    if not isinstance(rule, str) or rule not in LAST_TOKEN_RULES:
        raise TransferError(f"last-token rule {rule!r}, this instance reads {sorted(LAST_TOKEN_RULES)}")
    num_tokens, unshipped = desc.get("num_tokens"), LAST_TOKEN_RULES[rule]
    if not _is_int(num_tokens) or num_tokens < 1 or num_tokens != len(prompt_token_ids) - unshipped:
        raise TransferError(
            f"descriptor covers {num_tokens!r} tokens; the prompt has {len(prompt_token_ids)} "
            f"(rule {rule}: expected N{'-1' if unshipped else ''})"
        )
    if rule == ADOPT_RULE:
        first = desc.get("first_token")
        if not _is_int(first) or not 0 <= first < signature["vocab_size"]:
            raise TransferError(f"descriptor's first_token {first!r} is not a token id of this model")
    elif "first_token" in desc:
        raise TransferError(f"first_token comes only with rule {ADOPT_RULE}")
    if desc.get("token_digest") != token_digest(prompt_token_ids[:num_tokens]):
        raise TransferError("descriptor's token digest does not match this request's prompt")
    if desc.get("model") != signature:
        model = desc.get("model")
        if (
            isinstance(model, dict)
            and model.get("fingerprint") != signature.get("fingerprint")
            and {k: v for k, v in model.items() if k != "fingerprint"}
            == {k: v for k, v in signature.items() if k != "fingerprint"}
        ):
            raise TransferError(
                "model mismatch: the prefill instance serves another checkpoint of the same "
                f"architecture (fingerprint {str(model.get('fingerprint'))[:16]!r} vs this "
                f"instance's {signature.get('fingerprint', '')[:16]!r})"
            )
        raise TransferError(f"model mismatch: prefill {str(model)[:400]} vs decode {signature}")
    page_size, num_pages = desc.get("page_size"), desc.get("num_pages")
    if not _is_int(page_size) or not 0 < page_size <= MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise TransferError(f"descriptor page_size {page_size!r} must be a power of two <= {MAX_PAGE_SIZE}")
    if not _is_int(num_pages) or num_pages != _pow2(-(-num_tokens // page_size)):
        raise TransferError(
            f"descriptor num_pages {num_pages!r}: {num_tokens} tokens in {page_size}-token pages "
            f"take {_pow2(-(-num_tokens // page_size))} (padded to a power of two)"
        )
    kv_dtype = desc.get("kv_dtype")
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise TransferError(f"descriptor kv_dtype {kv_dtype!r} is not one of {list(KV_DTYPES)}")
    if desc.get("kv_wire") != ("values" if kv_dtype == "float32" else "bits"):
        raise TransferError(f"kv_wire {desc.get('kv_wire')!r} does not fit kv_dtype {kv_dtype}")
    state_dtype = desc.get("state_dtype", "float32")
    if not isinstance(state_dtype, str) or state_dtype not in STATE_DTYPES:
        raise TransferError(f"descriptor state_dtype {state_dtype!r} is not one of {list(STATE_DTYPES)}")
    arrays = desc.get("arrays")
    if not isinstance(arrays, list) or not all(
        isinstance(a, list)
        and len(a) == 3
        and isinstance(a[0], str)
        and isinstance(a[1], list)
        and all(_is_int(d) and d >= 0 for d in a[1])
        and isinstance(a[2], str)
        for a in arrays
    ):
        raise TransferError("descriptor arrays must be [name, [dims], dtype] triples")
    return num_tokens


def descriptor_nbytes(desc: dict) -> int:
    """Bytes the descriptor's arrays occupy (after check_descriptor / expected_arrays)."""
    sizes = {"float32": 4, "uint32": 4, "uint16": 2, "uint8": 1}  # the wire dtypes (layout._to_wire)
    return sum(math.prod(shape) * sizes.get(dtype, 4) for _, shape, dtype in desc["arrays"])
