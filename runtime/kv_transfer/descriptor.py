"""The transfer descriptor: what a prefill instance holds for one request, as JSON.

    {"version": 1, "rule": "prefill_n_minus_1" | "prefill_n_adopt", "num_tokens": K,
     "token_digest": sha256 of the K ids, "first_token": id (prefill_n_adopt only),
     "page_size": 16, "num_pages": n (padded), "kv_dtype": "float32", "kv_wire": "values" | "bits",
     "model": {layer_types, num_kv_heads, head_dim, conv, rec, num_groups},
     "arrays": [[name, shape, wire dtype], ...]}          # the pulled arrays, in this order

Arrays: per attention position j of the layer pattern, `kv{j}.k` / `kv{j}.v` `[G*n, Hkv, ps, D]`
(the request's pages of every layer group g, g-major, padded with the null page) and for FP8
`kv{j}.k_scale` / `kv{j}.v_scale` `[G*n, Hkv]`; per GDN position j, `conv{j}` `[G, W-1, C]` and
`rec{j}` `[G, H, K, V]` float32 (the request's slot). The decode side checks every field
against its own model and the request's prompt before it uses a byte (`check_descriptor`).
Plain Python.
"""

from __future__ import annotations

import hashlib
import struct

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


def token_digest(token_ids) -> str:
    ids = [int(t) for t in token_ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


def model_signature(cfg, num_groups: int) -> dict:
    """What both sides must agree on (checkpoint architecture, not serving layout)."""
    sig = {"layer_types": list(cfg.layer_types[:cfg.layer_period()]), "num_groups": num_groups,
           "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size}
    if cfg.is_hybrid:
        sig["conv"] = [cfg.linear_conv_kernel_dim - 1, cfg.conv_dim]
        sig["rec"] = [cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim]
    return sig


def build_descriptor(*, prompt_token_ids, num_tokens: int, rule: str = LAST_TOKEN_RULE, page_size: int,
                     num_pages: int, kv_dtype: str, kv_wire: str, signature: dict, arrays: list[list]) -> dict:
    return {"version": DESCRIPTOR_VERSION, "rule": rule, "num_tokens": num_tokens,
            "token_digest": token_digest(prompt_token_ids[:num_tokens]), "page_size": page_size,
            "num_pages": num_pages, "kv_dtype": kv_dtype, "kv_wire": kv_wire, "model": signature,
            "arrays": arrays}


def check_descriptor(desc, *, prompt_token_ids, signature: dict) -> int:
    """The number of prompt tokens `desc` brings, or TransferError saying why it is unusable."""
    if not isinstance(desc, dict):
        raise TransferError("descriptor must be a JSON object")
    if desc.get("version") != DESCRIPTOR_VERSION:
        raise TransferError(f"descriptor version {desc.get('version')!r}, this instance reads {DESCRIPTOR_VERSION}")
    rule = desc.get("rule")
    if not isinstance(rule, str) or rule not in LAST_TOKEN_RULES:
        raise TransferError(f"last-token rule {rule!r}, this instance reads {sorted(LAST_TOKEN_RULES)}")
    num_tokens, unshipped = desc.get("num_tokens"), LAST_TOKEN_RULES[rule]
    if not isinstance(num_tokens, int) or num_tokens != len(prompt_token_ids) - unshipped:
        raise TransferError(f"descriptor covers {num_tokens!r} tokens; the prompt has {len(prompt_token_ids)} "
                            f"(rule {rule}: expected N{'-1' if unshipped else ''})")
    if rule == ADOPT_RULE:
        first = desc.get("first_token")
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < signature["vocab_size"]:
            raise TransferError(f"descriptor's first_token {first!r} is not a token id of this model")
    if desc.get("token_digest") != token_digest(prompt_token_ids[:num_tokens]):
        raise TransferError("descriptor's token digest does not match this request's prompt")
    if desc.get("model") != signature:
        raise TransferError(f"model mismatch: prefill {desc.get('model')} vs decode {signature}")
    page_size, num_pages = desc.get("page_size"), desc.get("num_pages")
    if not (isinstance(page_size, int) and isinstance(num_pages, int) and page_size > 0
            and num_pages * page_size >= num_tokens):
        raise TransferError(f"descriptor pages ({num_pages} of {page_size}) cannot hold {num_tokens} tokens")
    if desc.get("kv_wire") not in ("values", "bits"):
        raise TransferError(f"unknown kv_wire {desc.get('kv_wire')!r}")
    arrays = desc.get("arrays")
    if not isinstance(arrays, list) or not all(
            isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and isinstance(a[1], list) for a in arrays):
        raise TransferError("descriptor arrays must be [name, shape, dtype] triples")
    return num_tokens
