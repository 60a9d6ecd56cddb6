#!/usr/bin/env bash
# The real BFCL evaluator (bfcl-eval, PyPI) against a jaxserve server it starts and stops.
#
#   benchmarks/bfcl_eval_run.sh [driver options, e.g. --limit 50]
#
# 1. makes .bfcl-venv (git-ignored) with bfcl-eval if missing: bfcl-eval pins numpy, networkx
#    and filelock below the project's, and it is only an HTTP client, so it gets its own venv;
# 2. starts `server.cli serve` (the default model) with the project's Python on a free port and
#    waits for /health;
# 3. runs benchmarks/bfcl_eval_driver.py (bfcl generate + bfcl evaluate, forced tool calls,
#    every call checked against its schema), report in benchmarks/results/bfcl-eval/<date>.json;
# 4. stops the server by its PID (and its engine child) whatever happens.
#
# Environment: JAXSERVE_PYTHON (the project's Python; default .venv/bin/python, else python3),
# SERVE_ARGS (extra serve flags), BFCL_EVAL_VERSION (pip pin), OUT (the report path).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.bfcl-venv"
BFCL_EVAL_VERSION="${BFCL_EVAL_VERSION:-2026.3.23}"
if [[ -z "${JAXSERVE_PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then JAXSERVE_PYTHON="$ROOT/.venv/bin/python"; else JAXSERVE_PYTHON=python3; fi
fi
OUT="${OUT:-$ROOT/benchmarks/results/bfcl-eval/$(date +%F).json}"
WORK="$(mktemp -d /tmp/bfcl-eval.XXXXXX)"

if [[ ! -x "$VENV/bin/bfcl" ]]; then
  python3 -m venv "$VENV"
  # soundfile: bfcl-eval's model table imports qwen_agent, which imports it without declaring it.
  "$VENV/bin/pip" install -q "bfcl-eval==$BFCL_EVAL_VERSION" soundfile
fi

PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
SERVER_PID=""
stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  local children
  children="$(ps -o pid= --ppid "$SERVER_PID" 2>/dev/null || true)"
  kill -TERM "$SERVER_PID" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$SERVER_PID" 2>/dev/null || true
  for child in $children; do  # the engine process, by the PID it had under the server
    for _ in $(seq 1 20); do kill -0 "$child" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$child" 2>/dev/null || true
  done
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

echo "server log: $WORK/server.log"
# shellcheck disable=SC2086
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$JAXSERVE_PYTHON" -m server.cli serve \
  --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --set model.keep_gguf_quantized=false \
  ${SERVE_ARGS:-} >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then tail -20 "$WORK/server.log"; echo "server exited" >&2; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { tail -20 "$WORK/server.log"; echo "no /health in 300 s" >&2; exit 1; }

"$VENV/bin/python" "$ROOT/benchmarks/bfcl_eval_driver.py" --url "http://127.0.0.1:$PORT" \
  --workdir "$WORK/bfcl" --json "$OUT" "$@"
echo "report: $OUT (bfcl results and scores: $WORK/bfcl)"
