import sys, time
from configs import CONFIG_DIR, load_config
from runtime.aot.chip_report import plan_config
from runtime.aot.plan_report import format_report
name = "tpu-v5e-8-qwen3_5-27b.yaml"
over = {"model.path": "/models/Nemotron-H-8B-Base-8K", "model.max_model_len": 8192, "model.served_model_name": "nemotron-h-8b",
        "parallel.chip": "tpu-v6e", "parallel.topology": "1x1", "parallel.mesh": {"data": 1, "model": 1},
        "scheduler.max_num_seqs": 32, "scheduler.max_num_batched_tokens": 2048, "cache.memory_fraction": 0.9}
launch = load_config(CONFIG_DIR / name, over)
t0 = time.time()
buckets = tuple(int(b) for b in sys.argv[1].split(","))
report = plan_config(launch, name + " with " + ", ".join(f"{k}={v}" for k, v in over.items()), token_buckets=buckets, compile_sampler=False, compile_cost=False)
print(format_report(report))
print(f"# planned in {time.time() - t0:.1f} s")
