"""Expert parallelism (EP) vs expert-intermediate tensor parallelism (TP) for one MoE block.

    python -m benchmarks.expert_parallel [--devices 4] [--tokens 16,256] [--repeats 20] [--json out.json]

A Qwen3-Next-shaped MoE block scaled down (hidden 256, 64 experts, top-10, expert intermediate 128,
shared expert 128; the real model: 2048, 512, top-10, 512, 512) with random weights, on
`--devices` simulated CPU devices (mesh data 1 x model M). For each token count T (a decode
batch, a prefill chunk) and each layout it reports:

- the step time of the jitted block (median of `--repeats`; CPU collectives are memcpys, so this
  says little about ICI / NVLink: read the ratio with care);
- the collectives of the compiled HLO, per device: kind, count and buffer bytes, and the bytes on
  the wire under the usual algorithms (ring all-reduce 2(M-1)/M of its buffer, all-gather /
  reduce-scatter / all-to-all (M-1)/M, collective-permute 1x);
- the compiler's cost_analysis flops and bytes accessed of one device's program;
- max |EP - single device|, |TP - single device| (the layouts must agree).

`--real` adds the same byte formulas evaluated at the real Qwen3-Next-80B sizes (no compile).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from types import SimpleNamespace

COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
    r"(?:-start)?\("
)
SHAPE = re.compile(r"(f32|bf16|f16|s32|u32|s8|u8|pred)\[([0-9,]*)\]")
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
SMALL = dict(hidden=256, experts=64, top_k=10, intermediate=128, shared=128)
QWEN3_NEXT_80B = dict(hidden=2048, experts=512, top_k=10, intermediate=512, shared=512)


def wire_factor(kind: str, m: int) -> float:
    """Bytes one device sends per byte of the collective's (per-device) result buffer."""
    return {"all-reduce": 2 * (m - 1) / m, "collective-permute": 1.0}.get(kind, (m - 1) / m)


def collectives(hlo_text: str, m: int) -> dict[str, dict]:
    """{kind: {count, buffer_bytes, wire_bytes}} of the collectives in one device's compiled HLO."""
    out: dict[str, dict] = {}
    for line in hlo_text.splitlines():
        found = COLLECTIVE.search(line)
        if found is None or "-done" in line:
            continue
        shapes, kind = found.groups()
        size = sum(ITEMSIZE[dt] * _prod(dims) for dt, dims in SHAPE.findall(shapes))
        entry = out.setdefault(kind, {"count": 0, "buffer_bytes": 0, "wire_bytes": 0.0})
        entry["count"] += 1
        entry["buffer_bytes"] += size
        entry["wire_bytes"] += size * wire_factor(kind, m)
    return out


def _prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def analytic_wire_bytes(
    T: int, m: int, hidden: int, experts: int, top_k: int, intermediate: int, shared: int, itemsize: int = 2
) -> dict[str, float]:
    """Per-device bytes on the wire for one MoE block of T tokens, by formula.

    Ideal TP (activations replicated): the routed experts' and the shared expert's row-parallel
    outputs meet in one all-reduce of [T, H]. Today's TP (what GSPMD compiles from
    models/transformer.py, read from the HLO): an all-reduce of the [T*top_k + T, H] rows before
    the weighted combine (collective-permutes not counted). EP (this repo's padded all-to-all): dispatch and combine each
    move M buffers of C = T/M * min(top_k, E/M) rows of H, then the token-split output is all-gathered;
    the shared expert still all-reduces [T, H]. A ragged all-to-all (TPU / GPU) would move only the
    real rows: on average T/M * top_k * (M-1)/M per direction."""
    row = hidden * itemsize
    tp = 2 * (m - 1) / m * T * row
    cap = (T // m) * min(top_k, experts // m)
    shared_ar = 2 * (m - 1) / m * T * row if shared else 0.0
    ep_padded = 2 * (m - 1) * cap * row + (m - 1) / m * T * row + shared_ar
    ep_ragged = 2 * (T / m) * top_k * (m - 1) / m * row + (m - 1) / m * T * row + shared_ar
    tp_today = 2 * (m - 1) / m * T * (top_k + 1) * row
    return {"tp": tp, "tp_today": tp_today, "ep_padded": ep_padded, "ep_ragged": ep_ragged}


def _model_config(shape: dict):
    return SimpleNamespace(num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], norm_topk_prob=True)


def _params(shape: dict, key):
    import jax
    import jax.numpy as jnp

    H, E, I, S = shape["hidden"], shape["experts"], shape["intermediate"], shape["shared"]
    shapes = {
        "router": (H, E),
        "experts_gate_up": (E, H, 2 * I),
        "experts_down": (E, I, H),
        "shared_gate_proj": (H, S),
        "shared_up_proj": (H, S),
        "shared_down_proj": (S, H),
        "shared_expert_gate": (H, 1),
    }
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, s, jnp.float32) * s[-2] ** -0.5 for (name, s), k in zip(shapes.items(), keys)}


def _place(params, mesh, expert: bool):
    import jax
    from jax.sharding import NamedSharding

    from models.sharding import EXPERT, MOE_RULES, _spec_for

    rules = {**MOE_RULES, **({"experts_gate_up": EXPERT, "experts_down": EXPERT} if expert else {})}
    return {k: jax.device_put(v, NamedSharding(mesh, _spec_for(rules[k], v.ndim, "model"))) for k, v in params.items()}


def run(devices: int, token_counts: list[int], repeats: int, shape: dict = SMALL) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.ops import KernelOptions
    from models.sharding import TensorParallel
    from models.transformer import moe_mlp
    from runtime.parallel.mesh import make_mesh

    mesh = make_mesh(1, devices, devices=jax.devices()[:devices])
    cfg = _model_config(shape)
    params = _params(shape, jax.random.key(0))
    rows = []
    for T in token_counts:
        x = jax.random.normal(jax.random.key(T), (T, shape["hidden"]), jnp_float32())
        reference = np.asarray(jax.jit(lambda p, x: moe_mlp(p, x, cfg))(params, x))
        for layout in ("tp", "ep"):
            plan = TensorParallel(mesh=mesh, attention=False, gdn=False, expert=layout == "ep")
            opts = KernelOptions(attention="reference", gdn="reference", tp=plan)
            placed = _place(params, mesh, plan.expert)
            x_rep = jax.device_put(x, NamedSharding(mesh, P()))
            step = jax.jit(lambda p, x: moe_mlp(p, x, cfg, opts), out_shardings=NamedSharding(mesh, P()))
            compiled = step.lower(placed, x_rep).compile()
            out = np.asarray(compiled(placed, x_rep))
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(placed, x_rep))
                times.append(time.perf_counter() - t0)
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            comm = collectives(compiled.as_text(), devices)
            rows.append(
                {
                    "tokens": T,
                    "layout": layout,
                    "devices": devices,
                    "step_ms": 1e3 * statistics.median(times[2:]),
                    "max_abs_err_vs_single": float(np.abs(out - reference).max()),
                    "wire_bytes": sum(c["wire_bytes"] for c in comm.values()),
                    "collectives": comm,
                    "flops": float(cost.get("flops", 0.0)),
                    "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                    "analytic_wire_bytes_fp32": analytic_wire_bytes(T, devices, itemsize=4, **shape),
                }
            )
    return rows


def jnp_float32():
    import jax.numpy as jnp

    return jnp.float32


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'T':>5} {'layout':<6}{'step ms':>9}{'wire KiB':>10}{'GFLOP':>9}{'MB acc.':>9}{'err':>10}  collectives"]
    for r in rows:
        comm = ", ".join(
            f"{k} x{v['count']} {v['buffer_bytes'] / 1024:.0f} KiB" for k, v in sorted(r["collectives"].items())
        )
        lines.append(
            f"{r['tokens']:>5} {r['layout']:<6}{r['step_ms']:>9.2f}{r['wire_bytes'] / 1024:>10.1f}"
            f"{r['flops'] / 1e9:>9.3f}{r['bytes_accessed'] / 1e6:>9.2f}{r['max_abs_err_vs_single']:>10.1e}  {comm}"
        )
    return "\n".join(lines)


def format_real(devices: int, token_counts: list[int]) -> str:
    lines = [
        f"Qwen3-Next-80B MoE block, bf16, M={devices}: per-device wire MiB per layer (formula)",
        f"{'T':>6}{'ideal TP':>10}{'TP today':>10}{'EP padded':>12}{'EP ragged':>12}",
    ]
    for T in token_counts:
        b = analytic_wire_bytes(T, devices, **QWEN3_NEXT_80B)
        lines.append(
            f"{T:>6}{b['tp'] / 2**20:>10.2f}{b['tp_today'] / 2**20:>10.2f}{b['ep_padded'] / 2**20:>12.2f}{b['ep_ragged'] / 2**20:>12.2f}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tokens", default="16,256", help="token counts, comma-separated (multiples of --devices)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--real", action="store_true", help="also print the byte formulas at Qwen3-Next-80B sizes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = run(args.devices, tokens, args.repeats)
    print(format_rows(rows))
    if args.real:
        print(format_real(args.devices, [128, 1024, 8192]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": SMALL, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
