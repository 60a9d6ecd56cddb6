"""Multi-process serving: process 0 (the leader) schedules and serves HTTP; every other process
(a follower) replays the leader's executable calls, in the same order, with the same host inputs.

    leader = MultihostLeader.listen(config.parallel.multihost)       # process 0
    leader.attach(async_engine)    # wraps engine.executables; a lost follower marks the engine dead
    ...
    Follower(engine, config.parallel.multihost).follow()              # processes 1..N-1: exit code

One SPMD step over a mesh that spans several processes is N programs, one per process, that
must be launched in the same order with the same arguments: the collectives inside them pair up.
The leader's `StepExecutables` are wrapped (`LeaderExecutables`): before each call
(`run_write_table`, `run_table_backbone`, `run_table_greedy_backbone`, `run_prepare`,
`run_scoring_backbone`, `run_backbone`, `run_greedy_backbone`, `run_sampler`, `copy_states`) its
host arguments (the request table's `TableStep`, sampling metadata, prompt targets, bitmask,
slot pairs; attention DP's host-built `ForwardBatch`) go to every follower in one frame over TCP; the follower runs the same method of its own executables
with its own device arrays (`params`, `caches`, its own request table, the batch its own
`run_prepare` gathered, the last backbone's `hidden`, its last sampled tokens). Why not
`multihost_utils.broadcast_one_to_all` or the same scheduler on every process: docs/scaling.md.

Frame (leader -> follower): u32 header length, JSON header {seq, op, args, digest}, then the raw
bytes of the arrays the header describes. A follower checks that `seq` is the next step counter
and that the blake2b `digest` of header args + bytes matches; a mismatch is `DivergenceError`
(fatal, exit 3). After every token-producing call it answers a JSON line {"seq", "tokens"} with
the digest of the tokens it computed; the leader compares it with its own tokens' digest
(mismatch: the engine is marked dead). Followers also send {"hb": 1} every HEARTBEAT_S; the
leader's watchdog marks the engine dead when a follower's socket closes, it is silent for
`heartbeat_timeout_s`, or one call runs longer than `step_timeout_s`. A follower exits 1 when the
leader's socket closes, 0 after the leader's stop frame (`MultihostLeader.stop`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from models.batch import ForwardBatch
from runtime.steps.table_host import TableStep
from runtime.steps.sampling_metadata import SamplingMetadata
from runtime.steps.executables import TokenFeed

log = logging.getLogger("jaxserve.multihost")

HEARTBEAT_S = 0.5
CONNECT_TIMEOUT_S = 600.0  # followers wait this long for the leader's step channel (it compiles first)
SEND_TIMEOUT_S = 30.0
EXIT_LEADER_LOST, EXIT_FAILED, EXIT_DIVERGED = 1, 2, 3

# method -> its argument names in order. params / caches / hidden are each process's own device
# arrays; every other argument is a host value the leader sends.
STEP_METHODS = {
    "run_write_table": ("table", "write"),
    "run_prepare": ("table", "step", "prev_tokens"),
    "run_table_backbone": ("params", "caches", "table", "step", "prev_tokens"),
    "run_table_greedy_backbone": ("params", "caches", "table", "step", "prev_tokens"),
    "run_backbone": ("params", "caches", "batch", "feed"),
    "run_greedy_backbone": ("params", "caches", "batch", "feed"),
    "run_scoring_backbone": ("params", "caches", "batch", "targets"),
    "run_sampler": ("params", "hidden", "meta", "num_logprobs", "all_greedy", "bitmask", "table"),
    "copy_states": ("caches", "pairs"),
}
DEVICE_ARGS = frozenset({"params", "caches", "hidden", "table"})
# Host values on the leader travel; device values (the batch the request table's prepare
# gathered, the previous step's sampled tokens) travel as None: each process uses its own.
OWN_IF_ON_DEVICE = ("batch", "prev_tokens")
_DATACLASSES = {cls.__name__: cls for cls in (ForwardBatch, SamplingMetadata, TableStep)}


class DivergenceError(RuntimeError):
    """A follower received a step out of order, corrupted, or computed other tokens than the leader."""


class FollowerLost(RuntimeError):
    """A follower process died, went silent, or a step stopped making progress."""


def step_address(multihost) -> tuple[str, int]:
    """(host, port) of the leader's step channel: the coordinator's host, `step_port` or the
    coordinator's port + 1."""
    host, _, port = multihost.coordinator_address.rpartition(":")
    return host, multihost.step_port or int(port) + 1


# ---- wire format --------------------------------------------------------------------------------
def _describe(value, chunks: list[bytes], offset: list[int]):
    """JSON description of a host value; array bytes are appended to `chunks`."""
    if isinstance(value, (np.ndarray, np.generic)):
        pass
    elif value is None or isinstance(value, (bool, int, float, str)):
        return {"json": value}
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple, int)) for v in value):
        return {"json": [list(v) if isinstance(v, (list, tuple)) else v for v in value]}
    elif dataclasses.is_dataclass(value) and type(value).__name__ in _DATACLASSES:
        fields = {f.name: _describe(getattr(value, f.name), chunks, offset) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__name__, "fields": fields}
    array = np.asarray(value)
    data = array.tobytes()  # C order; keeps 0-d arrays 0-d (np.ascontiguousarray would not)
    chunks.append(data)
    offset[0] += len(data)
    return {"array": array.dtype.str, "shape": list(array.shape), "end": offset[0]}


def _restore(spec, body: memoryview):
    if "json" in spec:
        return spec["json"]
    if "dataclass" in spec:
        cls = _DATACLASSES[spec["dataclass"]]
        return cls(**{name: _restore(field, body) for name, field in spec["fields"].items()})
    dtype, shape = np.dtype(spec["array"]), tuple(spec["shape"])
    end = spec["end"]
    start = end - int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer(body[start:end], dtype=dtype).reshape(shape).copy()


def _digest(args_json: str, body: bytes) -> str:
    return hashlib.blake2b(args_json.encode() + body, digest_size=16).hexdigest()


def encode_frame(seq: int, op: str, args: dict) -> bytes:
    """One leader -> follower frame: op "stop", or a STEP_METHODS name with its host args."""
    chunks: list[bytes] = []
    described = {name: _describe(value, chunks, [sum(map(len, chunks))]) for name, value in args.items()}
    body = b"".join(chunks)
    args_json = json.dumps(described, sort_keys=True)
    header = json.dumps({"seq": seq, "op": op, "args": args_json, "digest": _digest(args_json, body),
                         "body": len(body)}).encode()
    return struct.pack(">I", len(header)) + header + body


def decode_frame(header: dict, body: bytes, expected_seq: int) -> tuple[str, dict]:
    """(op, host args) of a frame; DivergenceError if it is not step `expected_seq` as sent."""
    if header["seq"] != expected_seq:
        raise DivergenceError(f"received step {header['seq']}, expected step {expected_seq}")
    if _digest(header["args"], body) != header["digest"]:
        raise DivergenceError(f"step {expected_seq}: the inputs' digest does not match the leader's")
    op = header["op"]
    if op != "stop" and op not in STEP_METHODS:
        raise DivergenceError(f"step {expected_seq}: unknown operation {op!r}")
    view = memoryview(body)
    return op, {name: _restore(spec, view) for name, spec in json.loads(header["args"]).items()}


def read_frame(sock: socket.socket) -> tuple[dict, bytes] | None:
    """(header, body), or None when the peer closed the connection."""
    size = _recv_exact(sock, 4)
    if size is None:
        return None
    raw = _recv_exact(sock, struct.unpack(">I", size)[0])
    if raw is None:
        return None
    header = json.loads(raw)
    body = _recv_exact(sock, header["body"]) if header["body"] else b""
    return None if body is None else (header, body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def tokens_digest(tokens) -> str:
    return hashlib.blake2b(np.ascontiguousarray(np.asarray(tokens, np.int32)).tobytes(), digest_size=16).hexdigest()


def _tokens_of(method: str, result):
    if method == "run_greedy_backbone":
        return result[1]
    if method == "run_table_greedy_backbone":
        return result[2]
    if method == "run_sampler":
        return result.tokens
    return None


def _on_host(value) -> bool:
    """A numpy value (or a ForwardBatch of them) that the leader sends as it is."""
    return isinstance(value.input_ids if isinstance(value, ForwardBatch) else value, (np.ndarray, np.generic))


# ---- leader -------------------------------------------------------------------------------------
class LeaderExecutables:
    """The leader's `StepExecutables`, each step method first sent to every follower."""

    def __init__(self, inner, leader: "MultihostLeader"):
        self._inner, self._leader = inner, leader

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in STEP_METHODS:
            return attr

        def broadcast_then_call(*args, **kwargs):
            bound = {**dict(zip(STEP_METHODS[name], args)), **kwargs}
            host = {k: v for k, v in bound.items() if k not in DEVICE_ARGS}
            if host.get("feed") is not None:  # attention DP's TokenFeed: only its host rows travel, the
                host["feed"] = np.asarray(host["feed"].rows)  # tokens are each process's own last ones
            for name_ in OWN_IF_ON_DEVICE:
                if name_ in host and not _on_host(host[name_]):
                    host[name_] = None
            seq = self._leader.send(name, host)
            with self._leader.running(seq):
                result = attr(*args, **kwargs)
            tokens = _tokens_of(name, result)
            if tokens is not None:
                self._leader.expect_tokens(seq, tokens)
            return result

        return broadcast_then_call


class MultihostLeader:
    """Process 0's end of the step channel: one TCP connection per follower, a reader thread per
    connection (heartbeats and token digests) and a watchdog."""

    def __init__(self, server: socket.socket, followers: dict[int, socket.socket], streams: dict, multihost):
        self._server, self._followers = server, followers
        self.heartbeat_timeout_s, self.step_timeout_s = multihost.heartbeat_timeout_s, multihost.step_timeout_s
        self._seq = 0
        self._lock = threading.Lock()
        self._last_seen = {pid: time.monotonic() for pid in followers}
        self._call_started: tuple[int, float] | None = None  # (seq, monotonic start) of the running call
        self._tokens: dict[int, tuple] = {}  # seq -> (leader tokens, follower digests not yet checked, checked)
        self._stopping = False
        self.lost: BaseException | None = None
        self._on_lost = []
        self._done = threading.Event()
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-token-check")
        for pid, stream in streams.items():
            threading.Thread(target=self._read, args=(pid, stream), name=f"jaxserve-follower-{pid}",
                             daemon=True).start()
        threading.Thread(target=self._watch, name="jaxserve-multihost-watchdog", daemon=True).start()

    @classmethod
    def listen(cls, multihost, timeout_s: float = CONNECT_TIMEOUT_S) -> "MultihostLeader":
        """Bind the step channel and wait for all `num_processes - 1` followers to say hello."""
        host, port = step_address(multihost)
        server = socket.create_server((host, port), reuse_port=False)
        server.settimeout(timeout_s)
        followers: dict[int, socket.socket] = {}
        streams = {}  # pid -> the buffered reader of its socket (the hello line came through it)
        log.info("step channel on %s:%d: waiting for %d followers", host, port, multihost.num_processes - 1)
        while len(followers) < multihost.num_processes - 1:
            sock, peer = server.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = sock.makefile("rb")
            hello = json.loads(stream.readline() or b"{}")
            pid = hello.get("process_id")
            if not isinstance(pid, int) or not 0 < pid < multihost.num_processes or pid in followers:
                log.error("step channel: refusing %s (hello %r)", peer, hello)
                sock.close()
                continue
            sock.settimeout(max(SEND_TIMEOUT_S, 2 * multihost.heartbeat_timeout_s))  # sends; reads see heartbeats
            followers[pid], streams[pid] = sock, stream
            log.info("follower %d connected from %s", pid, peer)
        return cls(server, followers, streams, multihost)

    def attach(self, client) -> None:
        """Serve through `client` (an AsyncEngine): wrap its engine's executables, mark it dead
        when a follower is lost, stop the followers when it shuts down."""
        client.engine.executables = LeaderExecutables(client.engine.executables, self)
        self._on_lost.append(client.mark_dead)
        client.shutdown_hooks.append(self.finish)

    # -- steps --
    def send(self, op: str, args: dict) -> int:
        if self.lost is not None:
            raise FollowerLost(str(self.lost))
        with self._lock:
            self._seq += 1
            seq = self._seq
        frame = encode_frame(seq, op, args)
        for pid, sock in self._followers.items():
            try:
                sock.sendall(frame)
            except OSError as err:
                self._lose(FollowerLost(f"follower {pid}: sending step {seq} failed ({err})"))
                raise FollowerLost(str(self.lost)) from err
        return seq

    @contextlib.contextmanager
    def running(self, seq: int):
        """Time one executable call for the watchdog's `step_timeout_s`."""
        self._call_started = (seq, time.monotonic())
        try:
            yield
        finally:
            self._call_started = None

    def expect_tokens(self, seq: int, tokens) -> None:
        self._match_tokens(seq, leader_tokens=tokens)

    def _match_tokens(self, seq: int, leader_tokens=None, follower_digest: str | None = None) -> None:
        """Check every follower's digest of step `seq`'s tokens against the leader's tokens,
        whichever arrives first; the entry is dropped once all followers have been checked."""
        with self._lock:
            tokens, digests, checked = self._tokens.get(seq, (None, [], 0))
            tokens = tokens if leader_tokens is None else leader_tokens
            digests = digests if follower_digest is None else [*digests, follower_digest]
            if tokens is None or not digests:
                self._tokens[seq] = (tokens, digests, checked)
                return
            checked += len(digests)
            if checked >= len(self._followers):
                del self._tokens[seq]
            else:
                self._tokens[seq] = (tokens, [], checked)
        self._checker.submit(self._check_tokens, seq, tokens, digests)  # off the engine thread: it waits on the device

    def _check_tokens(self, seq: int, tokens, digests: list[str]) -> None:
        ours = tokens_digest(tokens)
        if any(theirs != ours for theirs in digests):
            self._lose(DivergenceError(f"step {seq}: a follower sampled other tokens than the leader"))

    # -- liveness --
    def _read(self, pid: int, stream) -> None:
        try:
            for line in stream:
                self._last_seen[pid] = time.monotonic()
                message = json.loads(line)
                if "tokens" in message:
                    self._match_tokens(message["seq"], follower_digest=message["tokens"])
        except (OSError, ValueError) as err:
            log.debug("follower %d reader: %s", pid, err)
        if not self._stopping:
            self._lose(FollowerLost(f"follower process {pid} closed its step channel (it died or exited)"))

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            now = time.monotonic()
            for pid, seen in self._last_seen.items():
                if now - seen > self.heartbeat_timeout_s:
                    self._lose(FollowerLost(f"follower {pid} silent for {now - seen:.1f} s"))
            started = self._call_started
            if started is not None and now - started[1] > self.step_timeout_s:
                self._lose(FollowerLost(f"step {started[0]} has run for {now - started[1]:.0f} s "
                                        f"(step_timeout_s={self.step_timeout_s:g})"))

    def _lose(self, err: BaseException) -> None:
        with self._lock:
            if self.lost is not None or self._stopping:
                return
            self.lost = err
        self._done.set()
        log.critical("multi-process serving lost: %s; the engine is marked dead", err)
        for callback in self._on_lost:
            callback(err)

    # -- shutdown --
    def finish(self) -> None:
        """The engine has stopped. Healthy: send every follower the stop frame, then leave the
        distributed runtime together (a barrier). Lost: exit 1 now, since the barrier would wait
        for a process that is gone."""
        if self.lost is not None:
            log.critical("exiting with status 1: %s", self.lost)
            logging.shutdown()
            os._exit(EXIT_LEADER_LOST)
        self._stopping = True
        self._done.set()
        frame = encode_frame(self._seq + 1, "stop", {})
        for sock in self._followers.values():
            try:
                sock.sendall(frame)
            except OSError as err:
                log.warning("stop frame not delivered: %s", err)
        import jax

        jax.distributed.shutdown()
        self._server.close()


# ---- follower -----------------------------------------------------------------------------------
class Follower:
    """Processes 1..N-1: no HTTP; replay the leader's steps until its stop frame."""

    def __init__(self, engine, multihost):
        self.engine, self.multihost = engine, multihost
        self.caches, self.hidden = engine.caches, None
        # this process's own request table and the batch its last run_prepare gathered
        self.table, self.batch = getattr(engine, "table", None), None
        self.last_tokens = None  # this process's tokens of the last sampling call (prev_tokens, TokenFeed)
        self.steps = 0

    def follow(self) -> int:
        """Connect, replay steps until the stop frame, then leave the distributed runtime and
        return 0. Leader gone (1), a failed step (2), divergence (3): close the channel (the
        leader's watchdog sees it at once) and exit without the shutdown barrier."""
        sock = self._connect()
        threading.Thread(target=self._heartbeat, args=(sock,), name="jaxserve-heartbeat", daemon=True).start()
        pid = self.multihost.process_id
        try:
            code = self._replay(sock)
        except DivergenceError as err:
            log.critical("process %d diverged from the leader: %s", pid, err)
            code = EXIT_DIVERGED
        except Exception:  # noqa: BLE001 - this process can no longer follow: say so and leave
            log.critical("process %d: step %d failed", pid, self.steps, exc_info=True)
            code = EXIT_FAILED
        log.info("follower %d: %d steps replayed, exit code %d", pid, self.steps, code)
        if code != 0:
            sock.close()
            logging.shutdown()
            os._exit(code)
        import jax

        jax.distributed.shutdown()
        return 0

    def _connect(self) -> socket.socket:
        host, port = step_address(self.multihost)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._send(sock, {"process_id": self.multihost.process_id})
        log.info("follower %d connected to the leader at %s:%d", self.multihost.process_id, host, port)
        return sock

    def _send(self, sock: socket.socket, message: dict) -> None:
        with self._send_lock:
            sock.sendall(json.dumps(message).encode() + b"\n")

    def _heartbeat(self, sock: socket.socket) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self._send(sock, {"hb": 1})
            except OSError:  # the leader is gone while this process may be stuck in a collective
                print("jaxserve follower: the leader is gone; exiting 1", file=sys.stderr, flush=True)
                os._exit(EXIT_LEADER_LOST)

    def _replay(self, sock: socket.socket) -> int:
        while True:
            frame = read_frame(sock)
            if frame is None:
                log.error("follower %d: the leader closed the step channel", self.multihost.process_id)
                return EXIT_LEADER_LOST
            op, args = decode_frame(*frame, expected_seq=self.steps + 1)
            self.steps += 1
            if op == "stop":
                return 0
            tokens = _tokens_of(op, self.run(op, args))
            if tokens is not None:
                self._send(sock, {"seq": self.steps, "tokens": tokens_digest(tokens)})

    def _prev_tokens(self):
        return self.last_tokens if self.last_tokens is not None else self.engine._no_prev_tokens

    def run(self, op: str, args: dict):
        """One of the leader's executable calls, with this process's own device arrays."""
        own = {"params": self.engine.model.params, "caches": self.caches, "hidden": self.hidden, "table": self.table}
        names = STEP_METHODS[op]
        if args.get("feed") is not None:  # the leader's rows over this process's own previous tokens (checked)
            args = {**args, "feed": TokenFeed(self._prev_tokens(), args["feed"])}
        if "batch" in args and args["batch"] is None:  # prepared on the device: this process's own
            args = {**args, "batch": self.batch}
        if "prev_tokens" in args and args["prev_tokens"] is None:
            args = {**args, "prev_tokens": self._prev_tokens()}
        result = getattr(self.engine.executables, op)(**{n: own[n] for n in names if n in DEVICE_ARGS}, **args)
        tokens = _tokens_of(op, result)
        if tokens is not None:
            self.last_tokens = tokens
        if op == "run_prepare":
            self.table, self.batch = result
        elif op == "run_write_table":
            self.table = result
        elif op == "copy_states":
            self.caches = result
        elif op in ("run_backbone", "run_scoring_backbone"):
            self.caches, self.hidden = result[0], result[1]
        elif op == "run_greedy_backbone":
            self.caches = result[0]
        elif op == "run_table_backbone":
            self.caches, self.table, self.hidden = result
        elif op == "run_table_greedy_backbone":
            self.caches, self.table = result[0], result[1]
        return result
