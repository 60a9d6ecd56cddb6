#!/usr/bin/env bash
# One device session on an NVIDIA GPU, as one prepared script (device time is scarce):
#   1. the GPU Pallas kernels' tests, compiled on the GPU (the same cases CI runs in interpret mode)
#   2. kernel micro-benchmarks: Pallas vs the pure-jnp/XLA reference, against the HBM roofline
#   3. the engine offline vs the bare compiled loop on random checkpoints of real model shapes
#   4. engine-vs-HF greedy tests on the GPU
# Results go to $OUT (the device tool's output folder) or ./gpu-check. Each stage has its own
# time limit and the script goes on after a failure, so one broken stage costs only itself.
#   bash benchmarks/gpu_check.sh            # run from the repository root
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
if [ -d .whl ]; then  # packages the device image lacks, carried as wheels (pydantic, gguf)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  if [[ ",${GPU_CHECK_SKIP:-}," == *",$name,"* ]]; then return; fi  # GPU_CHECK_SKIP=a,b skips stages
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "stage $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/stages.txt"
  tail -n 25 "$OUT/$name.log"
}
{ nvidia-smi; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
head -n 20 "$OUT/env.txt"

stage kernel_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_paged_attention.py \
  tests/test_gdn.py ${GPU_CHECK_EXTRA_TESTS:-} -k "pallas_gpu or gpu_kernel or gpu"
stage kernels_attention 120 python3 -m benchmarks.kernels --impl pallas --repeats 10 \
  --only rpa_decode,rpa_prefill,kv_write,hbm_copy --json "$OUT/kernels_attention.json"
stage kernels_gdn 90 python3 -m benchmarks.kernels --impl pallas --repeats 5 \
  --only gdn_prefill,gdn_decode,causal_conv --json "$OUT/kernels_gdn.json"
stage kernels_reference 60 python3 -m benchmarks.kernels --impl reference --repeats 5 \
  --only rpa_decode,gdn_prefill,gdn_decode,causal_conv --json "$OUT/kernels_reference.json"
stage kernels_fp8 45 python3 -m benchmarks.kernels --impl pallas --kv-dtype fp8_e4m3 --only rpa_decode \
  --json "$OUT/kernels_fp8.json"

# SmolLM2-135M's shape with random weights (no hub): engine vs the bare compiled loop, bf16.
CKPT=/tmp/smollm2-shape
python3 -m models.random_checkpoint llama "$CKPT" --hidden-size 576 --intermediate-size 1536 \
  --num-hidden-layers 30 --num-attention-heads 9 --num-key-value-heads 3 --head-dim 64 \
  --vocab-size 49152 --max-position-embeddings 8192 --dtype bfloat16 >"$OUT/checkpoint.log" 2>&1
stage engine_smollm2_shape 140 python3 -m benchmarks.throughput "$CKPT" --only throughput \
  --workload fixed --scale 1 --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 \
  --repeats 3 --skip-hf --skip-vllm --json "$OUT/engine_smollm2_shape.json"
stage engine_hf 70 python3 -m pytest -q -p no:cacheprovider tests/test_engine_hf.py -x -k "llama or qwen3_5"
cat "$OUT/stages.txt"
