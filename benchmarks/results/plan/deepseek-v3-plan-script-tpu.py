"""DeepSeek-V3 on a TPU v5p-64 slice (EP 32), planned with libtpu's compiler on the CPU host:
    PYTHONPATH=. python benchmarks/results/plan/deepseek-v3-plan-script-tpu.py 64 [0.85] [/models/DeepSeek-V3-FP8]
(the launch config of tpu-v5p-64-deepseek-v3-mf085-T64.txt; argv: token buckets, memory_fraction, model
path: /models/DeepSeek-V3 (default) plans the shipped config without its quantization_config, bf16
weights; /models/DeepSeek-V3-FP8 the published block-FP8 one, its projections held as FP8 codes with
128 x 128 block scales as models/prequantized.py loads them)."""

import json
import sys
import time

from configs import load_config
from runtime.aot.chip_report import plan_config
from runtime.aot.plan_report import format_report, report_json

over = {
    "model.path": sys.argv[3] if len(sys.argv) > 3 else "/models/DeepSeek-V3",
    "model.dtype": "bfloat16",
    "model.max_model_len": 32768,
    "cache.page_size": 128,
    "cache.num_pages": None,
    "cache.memory_fraction": float(sys.argv[2]) if len(sys.argv) > 2 else 0.85,
    "cache.enable_prefix_caching": True,
    "scheduler.max_num_seqs": 64,
    "scheduler.max_num_batched_tokens": 4096,
    "scheduler.token_buckets": [64, 4096],
    "parallel.mesh": {"data": 1, "model": 32},
    "parallel.expert": True,
    "parallel.chip": "tpu-v5p",
    "parallel.topology": "4x4x2",
    "compile.aot": True,
}
launch = load_config(None, over)
t0 = time.time()
buckets = tuple(int(b) for b in sys.argv[1].split(","))
report = plan_config(
    launch, "tpu-v5p-64-deepseek-v3.yaml", token_buckets=buckets, compile_sampler=False, compile_cost=False
)
print(format_report(report))
print("fits", report.fits, "problems", report.problems, f"seconds {time.time() - t0:.1f}")
print("JSON " + json.dumps(report_json(report)))
