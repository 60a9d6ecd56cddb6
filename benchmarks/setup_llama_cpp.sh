#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the C++ CPU baseline) from the llama-cpp-python sdist, which
# vendors llama.cpp, into .cache/peers/llama.cpp, and convert the shared HF checkpoint to an f32 GGUF.
#
#   bash benchmarks/setup_llama_cpp.sh [HF_CHECKPOINT_DIR]   # default .cache/peers/smollm2-135m-hf
#
# Result: .cache/peers/llama.cpp/bin/llama-server and .cache/peers/llama.cpp/gguf/<checkpoint name>-f32.gguf.
# ~8 min on 2 idle cores (~30 min on the shared, loaded machine). Needs cmake, ninja, a C++ compiler and
# the `gguf` Python package (in jaxserve's venv); the converter also imports `sentencepiece` (even for
# BPE tokenizers), which goes into .cache/peers/llama.cpp/pydeps, not into jaxserve's venv.
# llama.cpp is never a jaxserve dependency; it only runs as a separate server process.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
CKPT="${1:-$REPO/.cache/peers/smollm2-135m-hf}"
PEERS="$REPO/.cache/peers"
SRC="$PEERS/llama-src"
OUT="$PEERS/llama.cpp"
JOBS="${JOBS:-$(nproc)}"

mkdir -p "$SRC" "$OUT"
if [ ! -x "$OUT/bin/llama-server" ]; then
  if ! ls "$SRC"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --no-binary :all: --no-deps llama-cpp-python -d "$SRC"
  fi
  SDIST="$(ls "$SRC"/llama_cpp_python-*.tar.gz | sort -V | tail -1)"
  tar -xzf "$SDIST" -C "$SRC"
  VENDORED="$(dirname "$SDIST")/$(basename "$SDIST" .tar.gz)/vendor/llama.cpp"
  # CPU only, native ISA (AVX-512/AMX where the host has them), no curl (local files only).
  cmake -S "$VENDORED" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
  cmake --build "$SRC/build" --target llama-server -j "$JOBS"
  mkdir -p "$OUT/bin"
  cp "$SRC/build/bin/llama-server" "$OUT/bin/"
  cp "$VENDORED/convert_hf_to_gguf.py" "$OUT/"
  rm -rf "$OUT/conversion" && { [ -d "$VENDORED/conversion" ] && cp -r "$VENDORED/conversion" "$OUT/" || true; }
fi

GGUF="$OUT/gguf/$(basename "$(cd "$CKPT" && pwd)")-f32.gguf"
if [ ! -f "$GGUF" ]; then
  [ -d "$OUT/pydeps/sentencepiece" ] || "$PY" -m pip install --target "$OUT/pydeps" sentencepiece
  mkdir -p "$OUT/gguf"
  PYTHONPATH="$OUT/pydeps" "$PY" "$OUT/convert_hf_to_gguf.py" "$CKPT" --outtype f32 --outfile "$GGUF.partial"
  mv "$GGUF.partial" "$GGUF"
fi
echo "llama-server: $OUT/bin/llama-server"
echo "gguf:         $GGUF"
