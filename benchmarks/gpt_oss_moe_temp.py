"""What the gpt-oss-120b step's HLO temporaries on TPU v5p are made of (issue 34), from libtpu's compiler.

1. The whole T=16 backbone of gpt-oss-120b (configs/models/gpt-oss-120b.json, bf16, 4 v5p chips,
   model axis 4, pages of 128, the plan's 11956 pages and 256 sequences) compiled twice: KV pages
   stored [P, Hkv, ps, D] (head_dim 64 padded to 128 lanes by the TPU kernel's tiles) and
   token-minor [P, Hkv, D, ps] (the engine's layout on TPU since `kv_page_layout`). The first is the
   earlier plan's 133 GB "HLO temporaries exceed HBM": a lane-padded copy of the KV pool, not the MoE.
2. One MoE projection as one device of that mesh holds it (128 experts; gate_up [2880, 1440], down
   [720, 2880]), bf16 and MXFP4-as-int8 (`qragged_dot`, models/mxfp4.py; gate_up only: 720 is no
   multiple of the 32-blocks), for 64 routed rows (T=16, top-4) and 16384 (T=4096): the temp and its
   largest buffers.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/gpt_oss_moe_temp.py

Writes benchmarks/results/window-paging/gpt-oss-120b-moe-temp.json. No TPU needed (compile only).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from configs.schema import CONFIG_DIR, LaunchConfig
from models.abstract import abstract_caches, abstract_model, shard_abstract_model
from models.config import parse_config
from models.ops import KernelOptions
from models.quantization import QuantizedWeight, qragged_dot
from models.safetensors_io import read_json
from runtime.aot.chip_report import target_mesh
from runtime.steps.executables import StepExecutables, StepKey

RESULTS = Path(__file__).parent / "results" / "window-paging"
MODEL_JSON = CONFIG_DIR / "models" / "gpt-oss-120b.json"
NUM_PAGES, PAGE_SIZE, SEQS, T = 11956, 128, 256, 16  # the plan's pool (gpt-oss-120b-32k.json, no window paging)
BYTES = {"bf16": 2, "f32": 4, "s32": 4, "s8": 1, "u8": 1, "pred": 1}


def largest_buffers(compiled, count: int = 6) -> list[str]:
    """The largest array shapes in the optimized HLO (parameters and temporaries alike), by bytes."""
    rows = []
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)", line)
        if m and m.group(1) in BYTES:
            n = 1
            for d in filter(None, m.group(2).split(",")):
                n *= int(d)
            rows.append((n * BYTES[m.group(1)], f"{m.group(1)}[{m.group(2)}] {m.group(3)}"))
    seen, out = set(), []
    for size, what in sorted(rows, reverse=True):
        if what not in seen:
            seen.add(what)
            out.append(f"{size / 2**30:.2f} GiB {what}")
        if len(out) == count:
            break
    return out


def backbone_temp(token_minor: bool) -> dict:
    launch = LaunchConfig.model_validate(
        {
            "model": {"path": "gpt-oss-120b", "dtype": "bfloat16", "max_model_len": 32768},
            "parallel": {"mesh": {"data": 1, "model": 4}, "chip": "tpu-v5p", "topology": "2x2x1"},
        }
    )
    cfg = parse_config(read_json(MODEL_JSON))
    model = abstract_model(cfg, "bfloat16", "gpt-oss-120b")
    shard_abstract_model(model, target_mesh(launch))
    caches = abstract_caches(model, NUM_PAGES, PAGE_SIZE, 2, "bfloat16", token_minor=token_minor)
    opts = KernelOptions(attention="pallas_tpu", gdn="pallas_tpu", tp=model.tp)
    exes = StepExecutables(
        model, caches, opts, token_buckets=(T,), seq_buckets=(SEQS,), max_num_seqs=SEQS, max_blocks_per_seq=256
    )
    try:
        compiled = exes.compile(StepKey("backbone", T))
    except jax.errors.JaxRuntimeError as err:
        return {"token_minor": token_minor, "fits": False, "error": str(err).splitlines()[0]}
    mem = compiled.memory_analysis()
    return {
        "token_minor": token_minor,
        "fits": True,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "largest_buffers": largest_buffers(compiled),
    }


def moe_projection_temp(kind: str, k: int, n: int, rows: int) -> dict:
    from jax.experimental import topologies

    device = topologies.get_topology_desc("v5p:2x2x1", platform="tpu", chips_per_host_bounds=(2, 2, 1)).devices[0]
    on = SingleDeviceSharding(device)
    E = 128

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=on)

    if kind == "mxfp4":
        w = QuantizedWeight(spec((E, k, n), jnp.int8), spec((E, k // 32, n), jnp.float32), bits=8, group_size=32)
    else:
        w = spec((E, k, n), jnp.bfloat16)
    x, sizes = spec((rows, k), jnp.bfloat16), spec((E,), jnp.int32)
    compiled = jax.jit(qragged_dot).lower(x, w, sizes).compile()
    mem = compiled.memory_analysis()
    return {
        "weights": kind,
        "experts_k_n": [E, k, n],
        "rows": rows,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "largest_buffers": largest_buffers(compiled, 4),
    }


def main() -> None:
    backbone = {layout: backbone_temp(layout == "token_minor") for layout in ("lane_padded", "token_minor")}
    # the down projection's per-device input dim (2880 / 4 = 720) is no multiple of MXFP4's 32-blocks:
    # bf16 only there
    shapes = {"bf16": ((2880, 1440), (720, 2880)), "mxfp4": ((2880, 1440),)}
    moe = [moe_projection_temp(kind, k, n, rows) for kind in shapes for k, n in shapes[kind] for rows in (64, 16384)]
    result = {
        "model": "gpt-oss-120b (configs/models/gpt-oss-120b.json), TPU v5p, model axis 4, compile only (libtpu)",
        "backbone_T16": backbone,
        "moe_projection_per_device": moe,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "gpt-oss-120b-moe-temp.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
