"""Weight quantization, measured: quality, memory, CPU throughput, bytes per decode step.

    python -m benchmarks.quantization --json quant.json                 # all sections
    python -m benchmarks.quantization --only memory                     # or quality / throughput / bytes
    python -m benchmarks.quantization --prompts 16 --tokens 32          # scaled down

Schemes: fp32 (the reference), int8, fp8, w8a8-int8, w8a8-fp8, int4-g128 (int4-sym), int4-zp-g32
(online RTN, default keep-float rules: embedding and lm_head in float), and gguf-q4_1 (the
default model's own Q4_1 blocks kept quantized). The
reference is the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized to float32: the
real float checkpoint is not on PyPI, so online schemes quantize those float32 weights and
gguf-q4_1 *is* the reference's weights (its rows measure the kept-quantized path, not a loss).
`--schemes` picks quality rows among those, `int4-default` (`--quantization int4` as configured
by default), the int4 recipe grid (int4-g32 / g64 / g128 symmetric,
int4-zp-g32 / g64 / g128) and `int8+embed`, `int4-g128+embed`, `int4-zp-g32+embed` (the embedding
/ tied lm_head quantized too, as the default rules did before), `@embed-only` rows (only the
embedding / tied head quantized). `--dither` moves the reference off the Q4_1 grid (which
int4-zp-g32 reproduces exactly): the GGUF weights plus one rounding step of uniform noise.

quality     greedy agreement over P prompts x N tokens through `LLM.generate` (share of
            positions equal to fp32's, and mean common prefix), and mean KL(fp32 || scheme) of
            the next-token distributions over a fixed stdlib docs text (teacher forced).
memory      parameter bytes on the device per scheme (SmolLM2 and the tiny Qwen3.5 hybrid), and
            the default model's process RSS and JAX live-buffer bytes with its GGUF dequantized
            vs kept quantized (each in a fresh subprocess).
throughput  offline `LLM.generate` output tokens/s per scheme on this CPU (compile excluded).
bytes       "bytes accessed" of one compiled one-token decode step (`cost_analysis()`; layers
            unrolled, since a scanned layer is counted once).
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# the default keep-float rules less embed_tokens / lm_head (the defaults before issue 32)
_EMBED = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
# row name -> (model.quantization, group size[, keep_float]); without keep_float: the default rules
# (embedding and lm_head in float). `+embed` rows quantize the embedding / tied lm_head as well.
ONLINE = {
    "int8": ("int8", 128),
    "fp8": ("fp8", 128),
    "w8a8-int8": ("w8a8-int8", 128),
    "w8a8-fp8": ("w8a8-fp8", 128),
    "int4-g128": ("int4-sym", 128),
    "int4-zp-g32": ("int4-zp", 32),
}
# the int4 recipe grid (--schemes ...): symmetric vs zero point, groups of 32 / 64 / 128
ONLINE.update({f"int4-g{g}": ("int4-sym", g) for g in (32, 64)} | {f"int4-zp-g{g}": ("int4-zp", g) for g in (64, 128)})
ONLINE["int4-default"] = ("int4",)  # what --quantization int4 gets (QuantizationConfig's defaults)
_INT4_GRID = ("int4-g32", "int4-g64", "int4-g128", "int4-zp-g32", "int4-zp-g64", "int4-zp-g128")
ONLINE.update({f"{row}+embed": (*ONLINE[row], _EMBED) for row in ("int8", "int4-g128", "int4-zp-g32")})
# only the embedding / tied lm_head quantized: SmolLM2's GGUF stores it as Q8_0, nearly float, so
# unlike its Q4_1 layers (which int4-zp-g32 reproduces exactly) it compares the int4 recipes fairly
_LAYERS = ("self_attn.*", "mlp.*", "linear_attn.*")
ONLINE.update({f"{row}@embed-only": (*ONLINE[row][:2], _LAYERS) for row in _INT4_GRID})
SCHEMES = ("fp32", "int8", "fp8", "w8a8-int8", "w8a8-fp8", "int4-g128", "int4-zp-g32", "gguf-q4_1")


def _dithered(params: dict) -> dict:
    """Every GGUF-quantized weight dequantized plus uniform noise of one rounding step (U(-s/2, s/2),
    s its block's scale): a float model as far from the Q4_1 / Q8_0 grid as the original float
    weights were, which no int4 recipe reproduces exactly (seeded, the same in every process)."""
    import jax
    import jax.numpy as jnp

    from models.quantization import QuantizedWeight, dequantize

    rng = np.random.default_rng(0)

    def undo(leaf, name):
        if not isinstance(leaf, QuantizedWeight):
            return leaf
        w = np.asarray(dequantize(leaf), np.float32)
        step = np.repeat(np.asarray(leaf.scale, np.float32), w.shape[-2] // leaf.scale.shape[-2], axis=-2)
        w = w + (rng.random(w.shape, np.float32) - 0.5) * step
        return jnp.asarray(np.swapaxes(w, -1, -2) if name == "embed" else w)

    out = {k: undo(v, k) for k, v in params.items() if k != "groups"}
    out["groups"] = tuple({k: undo(v, k) for k, v in g.items()} for g in params["groups"])
    return jax.block_until_ready(out)


def _model(name: str, path, dither: bool = False):
    from models import load_model
    from models.quant_rules import QuantizationConfig

    if name == "gguf-q4_1":
        return load_model(path)
    if dither:
        model = load_model(path)
        model.params, model.quantization = _dithered(model.params), {}
    else:
        model = load_model(path, keep_gguf_quantized=False)
    if name in ONLINE:
        model.quantize(QuantizationConfig(*ONLINE[name]))
    elif name != "fp32":
        raise ValueError(f"unknown scheme row {name!r}: fp32, gguf-q4_1 or one of {sorted(ONLINE)}")
    return model


def _docs_text() -> str:
    import collections
    import json as json_module
    import pathlib

    return "\n\n".join(inspect.getdoc(m) or "" for m in (json_module, collections, pathlib, inspect, argparse))


def _prompts(tokenizer, count: int) -> list[list[int]]:
    words = _docs_text().split()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        start = int(rng.integers(0, len(words) - 40))
        out.append(tokenizer.encode(" ".join(words[start : start + int(rng.integers(8, 40))])))
    return out


def _kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref_logits.astype(np.float64)), log_softmax(logits.astype(np.float64))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def _generate(model, prompts, tokens: int):
    from runtime import LLM, SamplingParams

    llm = LLM(
        model,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=256,
        token_buckets=(16, 64, 256),
        num_pages=len(prompts) * 16 + 1,
        max_model_len=256,  # prompts of at most 40 words (up to ~130 tokens) + up to 64 tokens
        enable_prefix_caching=False,
        aot_compile=False,
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # the same run once first: every bucket it uses is compiled
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outs], len(prompts) * tokens / seconds


def quality_and_throughput(
    path, prompts_count: int, tokens: int, kl_tokens: int, schemes=SCHEMES, dither: bool = False
) -> list[dict]:
    rows, ref = [], None
    for name in ("fp32", *(s for s in schemes if s != "fp32")):  # the reference first
        model = _model(name, path, dither)
        prompts = _prompts(model.tokenizer, prompts_count)
        text_ids = model.tokenizer.encode(_docs_text())[:kl_tokens]
        outs, tok_s = _generate(model, prompts, tokens)
        logits = model.logits(text_ids)
        row = {"scheme": name, "weight_bytes": model.weight_bytes(), "tok_s": round(tok_s, 1)}
        if ref is None:
            ref = (outs, logits)
        same = [np.mean(np.array(a) == np.array(b)) for a, b in zip(outs, ref[0])]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(outs, ref[0])]
        row.update(
            agreement=round(float(np.mean(same)), 4),
            mean_common_prefix=round(float(np.mean(prefix)), 1),
            mean_kl=round(_kl(ref[1], logits), 5),
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode_step_bytes(path) -> list[dict]:
    from models.batch import single_sequence_batch
    from models.model import _step_fn

    rows = []
    for name in SCHEMES:
        model = _model(name, path)
        model.unstack_layers()  # cost_analysis counts a scan body once, not once per layer
        batch = single_sequence_batch([5], 16)
        caches = model.init_caches(4, 16, 2)
        compiled = _step_fn(model.cfg, model._with_tp(None)).lower(model.params, caches, batch).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows.append(
            {"scheme": name, "bytes_accessed": int(cost.get("bytes accessed", 0)), "weight_bytes": model.weight_bytes()}
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def param_bytes_table(path, tiny_hybrid) -> list[dict]:
    rows = []
    for name in SCHEMES:
        row = {"scheme": name, "smollm2": _model(name, path).weight_bytes()}
        if tiny_hybrid is not None and name != "gguf-q4_1":
            from models import load_model
            from models.quant_rules import QuantizationConfig

            hybrid = load_model(tiny_hybrid)
            if name in ONLINE:
                hybrid.quantize(QuantizationConfig(ONLINE[name][0], group_size=32))  # 128 does not divide H=64
            row["tiny_qwen3_5"] = hybrid.weight_bytes()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


_RESIDENT = """
import json, resource, sys, jax, psutil
from models import load_model
m = load_model(sys.argv[1], keep_gguf_quantized=sys.argv[2] == "kept")
m.logits([5, 6, 7])
live = sum(a.nbytes for a in jax.live_arrays())
print(json.dumps({"gguf": sys.argv[2], "rss_mib": psutil.Process().memory_info().rss / 2**20,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "jax_live_mib": live / 2**20, "weight_mib": m.weight_bytes() / 2**20}))
"""


def resident_memory(path) -> list[dict]:
    rows = []
    for mode in ("dequantized", "kept"):
        out = subprocess.run(
            [sys.executable, "-c", _RESIDENT, str(path), mode],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=900,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantization", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", choices=("quality", "memory", "bytes"), default=None, help="one section (quality includes throughput)"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kl-tokens", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="quality rows (fp32 always runs first)")
    parser.add_argument(
        "--dither",
        action="store_true",
        help="quality: reference = the GGUF weights plus one rounding step of uniform noise, off the Q4_1 grid",
    )
    args = parser.parse_args(argv)
    from models.default_model import ensure_default_model

    path = ensure_default_model()
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_cached_checkpoint

    results = {"spec": vars(args) | {"json": str(args.json)}}
    if args.only in (None, "memory"):
        results["param_bytes"] = param_bytes_table(path, build_cached_checkpoint("qwen3_5"))
        results["resident"] = resident_memory(path)
    if args.only in (None, "bytes"):
        results["decode_step_bytes"] = decode_step_bytes(path)
    if args.only in (None, "quality"):
        results["quality"] = quality_and_throughput(
            path, args.prompts, args.tokens, args.kl_tokens, tuple(args.schemes.split(",")), args.dither
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
