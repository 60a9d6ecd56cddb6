import sys, time
from configs import CONFIG_DIR, load_config
from runtime.aot.chip_report import plan_config
from runtime.aot.plan_report import format_report
name = "gpu-h200-qwen3_5-9b.yaml"
launch = load_config(CONFIG_DIR / name, {"model.path": "/models/Nemotron-H-8B-Base-8K", "model.max_model_len": 8192,
                                          "model.served_model_name": "nemotron-h-8b", "server.reasoning_parser": None})
t0 = time.time()
buckets = tuple(int(b) for b in sys.argv[1].split(",")) if len(sys.argv) > 1 else ()
report = plan_config(launch, name + " with model.path=/models/Nemotron-H-8B-Base-8K, max_model_len 8192", token_buckets=buckets, compile_sampler=False, compile_cost=False)
print(format_report(report))
print(f"# planned in {time.time() - t0:.1f} s")
