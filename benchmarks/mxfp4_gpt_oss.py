"""MXFP4 gpt-oss checkpoints (experts kept as int8 + a float32 scale per 32) vs the bf16 checkpoint.

    python -m benchmarks.mxfp4_gpt_oss [--preset tiny|small] [--repeats 3] [--json out.json]

Per preset: a random bf16 gpt-oss checkpoint (models.random_checkpoint; `tiny` is the test shapes
with intermediate size 64, `small` a wider one whose experts dominate the bytes) and its MXFP4
conversion (models.mxfp4.write_mxfp4_checkpoint), both served in bf16. Measured:
- weight bytes as the engine accounts them (`Model.weight_bytes`), and the experts' share;
- load time (`load_model` until every parameter is on the device; median of `--repeats` after a
  warm-up, so both read from the page cache);
- decode output tokens/s through `LLM.generate` (bf16, greedy, `--seqs` prompts of 16 tokens,
  `--tokens` each; compile excluded by a warm-up run; the runs of the two checkpoints alternate);
- the greedy agreement of the two (MXFP4 rounds the weights: not expected to be 1).
And, by arithmetic from configs/models/gpt-oss-120b.json (`jaxserve plan` reads configs as float
and takes no checkpoint quantization, so it cannot give this figure): the experts' bytes in bf16,
as MXFP4-as-int8 (what the loader holds) and as MXFP4 on disk, in all and per chip over 8 chips.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from models.mxfp4 import BLOCK, write_mxfp4_checkpoint
from models.random_checkpoint import write_random_checkpoint

PRESETS = {
    "tiny": dict(intermediate_size=64),  # the test shapes (hidden 64, 4 experts top-2, 4 layers)
    "small": dict(
        hidden_size=512,
        intermediate_size=512,
        num_local_experts=16,
        num_experts_per_tok=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        swiglu_limit=7.0,
        sliding_window=128,
    ),
}


def _expert_bytes(model) -> int:
    from models.quantization import param_bytes

    return sum(param_bytes(g[k]) for g in model.params["groups"] for k in ("experts_gate_up", "experts_down") if k in g)


def _load(path):
    from models import load_model

    start = time.perf_counter()
    model = load_model(path, dtype="bfloat16")
    jax.block_until_ready(jax.tree.leaves(model.params))
    return model, time.perf_counter() - start


def _llm(path, seqs: int):
    from runtime import LLM

    return LLM(
        str(path),
        dtype="bfloat16",
        max_num_seqs=seqs,
        max_num_batched_tokens=256,
        num_pages=seqs * 16 + 1,
        max_model_len=256,
        enable_prefix_caching=False,
        aot_compile=False,
        load_tokenizer=False,
    )


def _generate(llm, prompts, tokens: int):
    from runtime import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], time.perf_counter() - start


def measure(preset: str, repeats: int, seqs: int, tokens: int, root: Path) -> dict:
    bf16 = write_random_checkpoint("gpt_oss", root / f"{preset}-bf16", dtype="bfloat16", **PRESETS[preset])
    mxfp4 = write_mxfp4_checkpoint(bf16, root / f"{preset}-mxfp4")
    paths = {"bf16": bf16, "mxfp4": mxfp4}
    row: dict = {"config": PRESETS[preset]}
    for name, path in paths.items():
        model, _ = _load(path)  # warm-up: page cache, first compiles of the placement
        times = [_load(path)[1] for _ in range(repeats)]
        row[name] = {
            "weight_bytes": model.weight_bytes(),
            "expert_bytes": _expert_bytes(model),
            "load_s_median": statistics.median(times),
            "load_s": times,
            "quantization": model.quantization,
            "checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        }
        vocab = model.cfg.vocab_size
        del model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, 16).tolist() for _ in range(seqs)]
    llms = {name: _llm(path, seqs) for name, path in paths.items()}
    outs = {}
    for name, llm in llms.items():
        outs[name], _ = _generate(llm, prompts, tokens)  # warm-up: compiles
        row[name]["decode_s"] = []
    for _ in range(repeats):
        for name, llm in llms.items():
            row[name]["decode_s"].append(_generate(llm, prompts, tokens)[1])
    for name in llms:
        row[name]["output_tokens_per_s"] = seqs * tokens / statistics.median(row[name]["decode_s"])
    same = [a == b for x, y in zip(outs["bf16"], outs["mxfp4"]) for a, b in zip(x, y)]
    row["greedy_agreement_mxfp4_vs_bf16"] = float(np.mean(same))
    row["weight_bytes_ratio_mxfp4_to_bf16"] = row["mxfp4"]["weight_bytes"] / row["bf16"]["weight_bytes"]
    row["expert_bytes_ratio_mxfp4_to_bf16"] = row["mxfp4"]["expert_bytes"] / row["bf16"]["expert_bytes"]
    return row


def gpt_oss_120b(chips: int = 8) -> dict:
    """The published gpt-oss-120b's expert bytes by format (arithmetic over its config's shapes)."""
    from configs import CONFIG_DIR
    from configs.chips import CHIPS
    from models.config import parse_config
    from models.safetensors_io import read_json
    from models.weights import abstract_params

    cfg = parse_config(read_json(CONFIG_DIR / "models" / "gpt-oss-120b.json"))
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    experts = cfg.num_layers * E * (H * 2 * I + I * H)
    total = sum(x.size for x in jax.tree.leaves(abstract_params(cfg, "bfloat16")))
    rest_bf16 = 2 * (total - experts)
    per_weight = {"bf16": 2.0, "mxfp4_as_int8_f32_scales": 1 + 4 / BLOCK, "mxfp4_on_disk": 0.5 + 1 / BLOCK}
    formats = {
        name: {
            "expert_bytes": int(experts * b),
            "expert_bytes_per_chip": int(experts * b / chips),
            "model_bytes_with_bf16_rest": int(experts * b + rest_bf16),
        }
        for name, b in per_weight.items()
    }
    return {
        "parameters": int(total),
        "expert_parameters": int(experts),
        "bytes_per_expert_weight": per_weight,
        "chips": chips,
        "formats": formats,
        "hbm_bytes": {name: CHIPS[name].hbm_bytes for name in CHIPS},
        "note": "arithmetic over configs/models/gpt-oss-120b.json: `jaxserve plan` takes no checkpoint quantization",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = {
        "machine": {"platform": platform.platform(), "backend": jax.default_backend(), "cpus": jax.device_count()},
        "seqs": args.seqs,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "presets": {},
        "gpt_oss_120b": gpt_oss_120b(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.preset or ["tiny"]:
            result["presets"][preset] = measure(preset, args.repeats, args.seqs, args.tokens, Path(tmp))
            print(json.dumps({preset: result["presets"][preset]}, indent=1))
    print(json.dumps(result["gpt_oss_120b"]["formats"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
