#!/usr/bin/env bash
# One device session on an NVIDIA GPU, as one prepared script (device time is scarce):
#   1. the GPU Pallas kernels' tests, compiled on the GPU (the same cases CI runs in interpret mode)
#   2. kernel micro-benchmarks: Pallas vs the pure-jnp/XLA reference, against the HBM roofline;
#      (the GDN GPU kernel vs XLA at 16 key / 32 value heads of 128: Qwen3.5-9B's and Qwen3-Next's
#      GDN shape); FP8 vs bf16 decode at the same shapes and page size (64, the H200 config's)
#   3. a split-KV decode grid at small batches (benchmarks/split_kv_decode.py): the one-program-per-
#      (sequence, kv head) kernel vs splitting each sequence's pages over S programs vs XLA
#   4. the engine end to end (asynchronous scheduling on vs off, benchmarks/async_scheduling.py) and
#      the engine vs the bare compiled loop (benchmarks/throughput.py), bf16, on random checkpoints of
#      SmolLM2-135M's shape and of Qwen3.5-9B's layer shapes (8 of its 32 layers: 2 layer groups)
#   4b. MTP speculative decoding's verify step vs a plain decode step (benchmarks/spec_verify_cost.py)
#      on the same Qwen3.5-9B-shaped checkpoint (8 layers, with its random MTP layer): batch 1-64 x
#      k 1, 2, 4, per step, and end-to-end tokens/s with oracle drafts at batch <= 4 (limit 240 s)
#   5. the compiled memory analysis of configs/gpu-h200-qwen3_5-9b.yaml: `jaxserve plan` compiles
#      every bucket on the GPU present (runtime/aot/chip_report.py; without a GPU it only lowers)
#   6. engine-vs-HF greedy tests on the GPU
# Results go to $OUT (the device tool's output folder) or ./gpu-check. Each stage has its own
# time limit and the script goes on after a failure, so one broken stage costs only itself.
#   bash benchmarks/gpu_check.sh                                  # from the repository root
#   GPU_CHECK_ONLY=plan_h200,split_kv bash benchmarks/gpu_check.sh   # only these stages
#   GPU_CHECK_SKIP=engine_hf bash benchmarks/gpu_check.sh            # all but these
#   GPU_CHECK_ONLY=spec_verify_cost bash benchmarks/gpu_check.sh     # issue 35: MTP verify cost alone
# The stages' limits add up to more than one 10-minute device call: run it as two calls,
# GPU_CHECK_ONLY=$KERNEL_STAGES and then GPU_CHECK_SKIP=$KERNEL_STAGES (the lists below).
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
KERNEL_STAGES=kernel_tests,kernels_attention,kernels_gdn,kernels_reference,kernels_fp8,kernels_bf16_decode,split_kv
wanted() {  # wanted NAME: GPU_CHECK_ONLY (if set) names it and GPU_CHECK_SKIP does not
  if [[ -n "${GPU_CHECK_ONLY:-}" && ",$GPU_CHECK_ONLY," != *",$1,"* ]]; then return 1; fi
  [[ ",${GPU_CHECK_SKIP:-}," != *",$1,"* ]]
}
stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "stage $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/stages.txt"
  tail -n 25 "$OUT/$name.log"
}
{ nvidia-smi; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; git log -1 --format=%H 2>/dev/null; } \
  >"$OUT/env.txt" 2>&1
head -n 20 "$OUT/env.txt"

# --- kernels -------------------------------------------------------------------------------------
stage kernel_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_paged_attention.py \
  tests/test_gdn.py ${GPU_CHECK_EXTRA_TESTS:-} -k "pallas_gpu or gpu_kernel or gpu"
stage kernels_attention 120 python3 -m benchmarks.kernels --impl pallas --repeats 10 \
  --only rpa_decode,rpa_prefill,kv_write,hbm_copy --json "$OUT/kernels_attention.json"
stage kernels_gdn 90 python3 -m benchmarks.kernels --impl pallas --repeats 5 \
  --only gdn_prefill,gdn_decode,causal_conv --json "$OUT/kernels_gdn.json"
stage kernels_reference 60 python3 -m benchmarks.kernels --impl reference --repeats 5 \
  --only rpa_decode,gdn_prefill,gdn_decode,causal_conv --json "$OUT/kernels_reference.json"
# FP8 vs bf16 decode: the same rpa_decode shapes and page size, only the KV dtype differs
stage kernels_fp8 45 python3 -m benchmarks.kernels --impl pallas --kv-dtype fp8_e4m3 --only rpa_decode \
  --page-size 64 --json "$OUT/kernels_fp8.json"
stage kernels_bf16_decode 45 python3 -m benchmarks.kernels --impl pallas --kv-dtype bf16 --only rpa_decode \
  --page-size 64 --json "$OUT/kernels_bf16_decode.json"
# split-KV decode grid: batch 1-16 x context 1k-32k x splits 1-16, bf16 and FP8, vs XLA
stage split_kv 120 python3 -m benchmarks.split_kv_decode --repeats 10 --json "$OUT/split_kv_decode.json"

# --- the engine ----------------------------------------------------------------------------------
# SmolLM2-135M's shape with random weights (no hub): bf16.
CKPT=/tmp/smollm2-shape
if wanted engine_smollm2_shape || wanted async_smollm2_shape || wanted fp8_engine_smollm2_shape; then
  python3 -m models.random_checkpoint llama "$CKPT" --hidden-size 576 --intermediate-size 1536 \
    --num-hidden-layers 30 --num-attention-heads 9 --num-key-value-heads 3 --head-dim 64 \
    --vocab-size 49152 --max-position-embeddings 8192 --dtype bfloat16 >"$OUT/checkpoint.log" 2>&1
fi
stage async_smollm2_shape 150 python3 -m benchmarks.async_scheduling "$CKPT" --workload fixed --scale 1 \
  --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 --repeats 3 \
  --json "$OUT/async_smollm2_shape.json"
stage engine_smollm2_shape 140 python3 -m benchmarks.throughput "$CKPT" --only throughput \
  --workload fixed --scale 1 --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 \
  --repeats 3 --skip-hf --skip-vllm --json "$OUT/engine_smollm2_shape.json"
# FP8 vs bf16 KV through the engine (same pages, all else equal)
stage fp8_engine_smollm2_shape 150 python3 -m benchmarks.throughput "$CKPT" --only kvdtype \
  --workload fixed --scale 1 --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 \
  --repeats 3 --skip-hf --skip-vllm --json "$OUT/fp8_engine_smollm2_shape.json"

# Qwen3.5-9B's layer shapes (hidden 4096, 16 q / 4 kv heads of 256, GDN 16 / 32 heads of 128, vocab
# 248320), 8 layers = 2 of its 4-layer groups (3 GDN + 1 attention): ~3.8B parameters, 7.6 GB bf16.
QCKPT=/tmp/qwen3_5-9b-shape
if wanted engine_qwen3_5_9b_shape || wanted async_qwen3_5_9b_shape || wanted spec_verify_cost; then
  LT='["linear_attention","linear_attention","linear_attention","full_attention","linear_attention","linear_attention","linear_attention","full_attention"]'
  python3 -m models.random_checkpoint qwen3_5 "$QCKPT" --hidden-size 4096 --intermediate-size 12288 \
    --num-hidden-layers 8 --num-attention-heads 16 --num-key-value-heads 4 --head-dim 256 \
    --linear-num-key-heads 16 --linear-num-value-heads 32 --linear-key-head-dim 128 --linear-value-head-dim 128 \
    --vocab-size 248320 --max-position-embeddings 32768 --dtype bfloat16 --std 0.02 \
    --set "layer_types=$LT" >"$OUT/checkpoint_qwen3_5.log" 2>&1
fi
stage async_qwen3_5_9b_shape 200 python3 -m benchmarks.async_scheduling "$QCKPT" --workload fixed --scale 1 \
  --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 --repeats 2 \
  --json "$OUT/async_qwen3_5_9b_shape.json"
stage engine_qwen3_5_9b_shape 200 python3 -m benchmarks.throughput "$QCKPT" --only throughput \
  --workload fixed --scale 1 --num-requests 64 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 \
  --repeats 2 --skip-hf --skip-vllm --json "$OUT/engine_qwen3_5_9b_shape.json"
# MTP verify step vs plain decode step (issue 35): the checkpoint above has the MTP layer
# (models/random_mtp.py); one plain engine and one per k, each compiling only the buckets it runs
stage spec_verify_cost 240 python3 -m benchmarks.spec_verify_cost --shape qwen3_5-9b-8layers \
  --checkpoint "$QCKPT" --batches 1,4,16,64 --ks 1,2,4 --repeats 20 --page-size 64 --e2e-max-batch 4 \
  --json "$OUT/verify-cost-gpu-qwen3_5-9b-8layers.json"

# --- the H200 config's compiled memory ------------------------------------------------------------
stage plan_h200 300 python3 -c "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))" \
  plan --config configs/gpu-h200-qwen3_5-9b.yaml --json "$OUT/plan_gpu_h200_qwen3_5_9b.json"

stage engine_hf 70 python3 -m pytest -q -p no:cacheprovider tests/test_engine_hf.py -x -k "llama or qwen3_5"
cat "$OUT/stages.txt"
