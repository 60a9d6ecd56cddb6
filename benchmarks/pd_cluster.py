"""Prefill, decode and proxy as separate processes on 127.0.0.1, for the P/D tests.

    with PDCluster(checkpoint, prefill=["--set", "cache.page_size=16"], decode=[...]) as pd:
        pd.proxy_url, pd.prefill_url, pd.decode_url, pd.stats("decode")

All three share the internal token (JAXSERVE_KV_TRANSFER_TOKEN, `TOKEN`), as a deployment
should. Each process binds a free port (port 0) and is found by its "ready at" log line; a reader
thread drains its output (a full pipe would block it) and keeps the tail for failure messages.
Every wait is bounded; `close` kills the processes by PID.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready at (http://[\d.]+:\d+)")
# Small and fast: no AOT compile (buckets compile on first use), a few sequences.
TOKEN = "pd-test-kv-transfer-token-0123456789"
BASE_FLAGS = [
    "--set",
    "model.dtype=float32",
    "--set",
    "compile.aot=false",
    "--set",
    "compile.cache_dir=null",
    "--set",
    "scheduler.max_num_seqs=4",
    "--set",
    "scheduler.max_num_batched_tokens=64",
    "--set",
    "cache.num_pages=96",
    "--set",
    "model.max_model_len=512",
    "--set",
    "server.port=0",
    "--log-level",
    "INFO",
]


class Process:
    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict | None = None,
        timeout_s: float = 240.0,
        launcher: list[str] = (),
        root: Path = ROOT,
    ):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=80)
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", "server.cli", *argv],
            cwd=root,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(root), "JAXSERVE_KV_TRANSFER_TOKEN": TOKEN, **(env or {})},
        )
        self._url: str | None = None
        self.num_lines = 0  # output lines read so far
        self._numbered: collections.deque[tuple[int, str]] = collections.deque(maxlen=400)
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or self._url is None:
            self.kill()
            raise RuntimeError(f"{name} did not become ready:\n" + "".join(self.tail))
        self.url = self._url

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            self._numbered.append((self.num_lines, line))
            self.num_lines += 1
            match = READY.search(line)
            if match and self._url is None:
                self._url = match.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def wait_for_line(self, pattern: str, since: int, timeout_s: float = 60.0) -> str:
        """The first output line numbered >= `since` (see `num_lines`) matching `pattern`,
        waiting for it (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for number, line in list(self._numbered):
                if number >= since and re.search(pattern, line):
                    return line
            time.sleep(0.01)
        raise TimeoutError(f"{self.name}: no line matching {pattern!r}:\n" + "".join(self.tail))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {name: value} (unlabelled samples only)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def all_free(metrics: dict[str, float]) -> bool:
    """No running/waiting request, no page or slot in use, nothing held for a pull."""
    m = metrics
    return (
        m.get("jaxserve_num_requests_running", 0) == 0
        and m.get("jaxserve_num_requests_waiting", 0) == 0
        and m["jaxserve_kv_pages_free"] + m["jaxserve_kv_pages_cached"] == m["jaxserve_kv_pages_total"]
        and m["jaxserve_state_slots_free"] + m["jaxserve_state_slots_cached"] == m["jaxserve_state_slots_total"]
        and m.get("jaxserve_kv_transfer_leases_held", 0) == 0
        and m.get("jaxserve_kv_transfer_requests_pulling", 0) == 0
    )


def wait_all_free(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        if all_free(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


class PDCluster:
    def __init__(
        self,
        checkpoint: Path,
        prefill: list[str] = (),
        decode: list[str] = (),
        proxy: list[str] = (),
        prefill_env: dict | None = None,
        decode_env: dict | None = None,
        root: Path = ROOT,
    ):
        """`root`: the source tree the three processes run (benchmarks compare two trees)."""
        self.processes: list[Process] = []
        self.root = root
        try:
            self.prefill = self._start(
                "prefill", ["serve", str(checkpoint), "--role", "prefill", *BASE_FLAGS, *prefill], prefill_env
            )
            self.decode = self._start(
                "decode", ["serve", str(checkpoint), "--role", "decode", *BASE_FLAGS, *decode], decode_env
            )
            self.proxy = self._start(
                "proxy",
                [
                    "proxy",
                    "--prefill",
                    self.prefill.url,
                    "--decode",
                    self.decode.url,
                    "--port",
                    "0",
                    "--log-level",
                    "INFO",
                    *proxy,
                ],
                None,
            )
        except BaseException:
            self.close()
            raise

    def _start(self, name, argv, env) -> Process:
        process = Process(name, argv, env, root=self.root)
        self.processes.append(process)
        return process

    @property
    def proxy_url(self) -> str:
        return self.proxy.url

    def close(self) -> None:
        for process in self.processes:
            process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
