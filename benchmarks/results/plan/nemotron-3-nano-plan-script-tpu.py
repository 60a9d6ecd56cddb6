import sys, time
from configs import CONFIG_DIR, load_config
from runtime.aot.chip_report import plan_config
from runtime.aot.plan_report import format_report

name = "tpu-v5e-8-qwen3_5-27b.yaml"
over = {
    "model.path": "/models/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "model.max_model_len": 32768,
    "model.served_model_name": "nemotron-3-nano-30b-a3b",
    "scheduler.max_num_seqs": 64,
}
launch = load_config(CONFIG_DIR / name, over)
t0 = time.time()
buckets = tuple(int(b) for b in sys.argv[1].split(",")) if len(sys.argv) > 1 else ()
report = plan_config(
    launch,
    name + " with " + ", ".join(f"{k}={v}" for k, v in over.items()),
    token_buckets=buckets,
    compile_sampler=False,
    compile_cost=False,
)
print(format_report(report))
print(f"# planned in {time.time() - t0:.1f} s")
