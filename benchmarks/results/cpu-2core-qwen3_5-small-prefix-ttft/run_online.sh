#!/usr/bin/env bash
# Online TTFT, prefix caching off vs on (hybrid checkpoint policy $POLICY, default auto), on the
# qwen3_5-small random hybrid (docs/benchmarks.md builds it; here in float32): `jaxserve serve`
# + benchmarks/serve.py, shared_prefix workload (2,048-token system prompt + 16-64-token user
# turns, 32 output tokens), one request at a time after one warm-up request.
set -euo pipefail
cd "$(dirname "$0")/../../.."
CKPT=${CKPT:-.cache/peers/qwen3_5-small}
OUT=benchmarks/results/cpu-2core-qwen3_5-small-prefix-ttft
POLICY=${POLICY:-auto}
PORT=${PORT:-8317}
PY=${PY:-/work/main/.venv/bin/python}
JIT_CACHE=$(mktemp -d)  # both servers share it: the second compiles nothing
for prefix in false true; do
  log=$OUT/online-$POLICY-prefix-$prefix-server.log
  PYTHONPATH=$PWD $PY -m server.cli serve --set model.path=$CKPT --set model.dtype=float32 \
    --set model.max_model_len=4096 --set model.served_model_name=bench-model --set server.port=$PORT \
    --set scheduler.max_num_seqs=16 --set scheduler.max_num_batched_tokens=256 \
    --set 'scheduler.token_buckets=[16, 64, 256]' --set compile.cache_dir=$JIT_CACHE \
    --set cache.enable_prefix_caching=$prefix --set cache.hybrid_checkpoint_policy=$POLICY > $log 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$PORT/v1/models > /dev/null && break; sleep 2; done
  PYTHONPATH=$PWD $PY -m benchmarks.serve --url http://127.0.0.1:$PORT --label prefix-$prefix \
    --workload shared_prefix --num-requests 9 --vocab-size 1000 --max-model-len 4096 --concurrency 1 \
    --warmup 1 --json $OUT/online-$POLICY-prefix-$prefix.json | tee $OUT/online-$POLICY-prefix-$prefix.log
  kill $pid; wait $pid 2>/dev/null || true
done
