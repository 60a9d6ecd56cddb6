# python benchmarks/results/plan/kimi-linear-48b-plan-script-tpu.py BUCKETS CHIP TOPOLOGY MODEL_AXIS
# (ALLOW_MULTIPLE_LIBTPU_LOAD=1; experts split by index when MODEL_AXIS > 1)
import sys, time
from configs import CONFIG_DIR, load_config
from runtime.aot.chip_report import plan_config
from runtime.aot.plan_report import format_report
name = "tpu-v5e-8-qwen3_5-27b.yaml"
model_axis = int(sys.argv[4])
over = {"model.path": "/models/Kimi-Linear-48B-A3B-Instruct", "model.max_model_len": 32768, "model.served_model_name": "kimi-linear-48b",
        "parallel.chip": sys.argv[2], "parallel.topology": sys.argv[3], "parallel.mesh": {"data": 1, "model": model_axis},
        "parallel.expert": model_axis > 1, "cache.kv_cache_dtype": "auto", "scheduler.max_num_seqs": 32,
        "scheduler.max_num_batched_tokens": 2048, "cache.memory_fraction": 0.9}
launch = load_config(CONFIG_DIR / name, over)
t0 = time.time()
buckets = tuple(int(b) for b in sys.argv[1].split(","))
report = plan_config(launch, name + " with " + ", ".join(f"{k}={v}" for k, v in over.items()), token_buckets=buckets, compile_sampler=False, compile_cost=False)
print(format_report(report))
print(f"# planned in {time.time() - t0:.1f} s")
