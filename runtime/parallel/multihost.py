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
slot pairs; attention DP's host-built `ForwardBatch`) go to every follower in one frame over TCP;
the follower runs the same method of its own executables with its own device arrays (`params`,
`caches`, its own request table, the batch its own `run_prepare` gathered, the last backbone's
`hidden`, its last sampled tokens). Why not `multihost_utils.broadcast_one_to_all` or the same
scheduler on every process: docs/scaling.md.

The channel (runtime/parallel/multihost_channel.py): a follower joins only after it and the leader proved
to each other that they hold `parallel.multihost.secret` (HMAC challenge-response); each frame
{seq, op, args, body, mac} carries a MAC keyed with that connection's session key. A follower
checks that `seq` is the next step counter and that the MAC holds; a mismatch is
`DivergenceError` (fatal, exit 3). After every token-producing call it answers a JSON line
{"seq", "tokens"} with the keyed digest of its tokens; the leader compares it with its own
tokens' (mismatch: the engine is marked dead).

Liveness, both ways, every HEARTBEAT_S: followers send {"hb": 1}; the leader sends an "hb" frame
when it has sent nothing else. The leader's watchdog marks the engine dead when a follower's
socket closes, it is silent for `heartbeat_timeout_s`, a send blocks for SEND_TIMEOUT_S (a
follower that stopped reading), or one call runs longer than `step_timeout_s`. A follower exits 1
when the leader's socket closes or is silent for `heartbeat_timeout_s`, 4 when the handshake
fails (wrong secret, not the leader), 0 after the leader's stop frame (`MultihostLeader.stop`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from models.batch import ForwardBatch
from runtime.parallel.multihost_channel import (
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT,
    DivergenceError,
    Frame,
    HandshakeError,
    Session,
    accept_followers,
    channel_secret,
    configure,
    decode_frame,
    encode_frame,
    follower_handshake,
    read_frame,
    step_address,
    step_bind_address,
    tokens_digest,
)
from runtime.steps.executables import TokenFeed

log = logging.getLogger("jaxserve.multihost")

HEARTBEAT_S = 0.5
CONNECT_TIMEOUT_S = 600.0  # followers wait this long for the leader's step channel (it compiles first)
SEND_TIMEOUT_S = 30.0  # a follower that has not read for this long is lost
EXIT_LEADER_LOST, EXIT_FAILED, EXIT_DIVERGED, EXIT_REFUSED = 1, 2, 3, 4

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


class FollowerLost(RuntimeError):
    """A follower process died, went silent, or a step stopped making progress."""


class LeaderLost(ConnectionError):
    """The leader closed the step channel, went silent, or stopped reading."""


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

    def __init__(self, inner, leader: MultihostLeader):
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
    """Process 0's end of the step channel: one authenticated TCP connection per follower, a reader
    thread per connection (heartbeats and token digests), a heartbeat sender and a watchdog."""

    def __init__(self, sessions: dict[int, Session], multihost, send_timeout_s: float = SEND_TIMEOUT_S):
        self._sessions = sessions
        self.heartbeat_timeout_s, self.step_timeout_s = multihost.heartbeat_timeout_s, multihost.step_timeout_s
        self._seq = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one whole frame at a time on every connection
        self._last_sent = time.monotonic()
        self._last_seen = {pid: time.monotonic() for pid in sessions}
        self._call_started: tuple[int, float] | None = None  # (seq, monotonic start) of the running call
        self._tokens: dict[int, tuple] = {}  # seq -> (leader tokens, follower digests not yet checked, checked)
        self._stopping = False
        self.lost: BaseException | None = None
        self._on_lost = []
        self._done = threading.Event()
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-token-check")
        for pid, session in sessions.items():
            session.sock.settimeout(max(send_timeout_s, 2 * self.heartbeat_timeout_s))  # reads see heartbeats
            threading.Thread(
                target=self._read, args=(pid, session.sock.makefile("rb")), name=f"jaxserve-follower-{pid}", daemon=True
            ).start()
        threading.Thread(target=self._watch, name="jaxserve-multihost-watchdog", daemon=True).start()
        threading.Thread(target=self._beat, name="jaxserve-leader-heartbeat", daemon=True).start()

    @classmethod
    def listen(
        cls, multihost, timeout_s: float = CONNECT_TIMEOUT_S, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> MultihostLeader:
        """Bind the step channel and wait for all `num_processes - 1` followers to authenticate;
        TimeoutError after `timeout_s`. Other connections are refused and do not hold it up."""
        secret = channel_secret(multihost)
        host, port = step_bind_address(multihost)
        with socket.create_server((host, port)) as server:
            log.info("step channel on %s:%d: waiting for %d followers", host, port, multihost.num_processes - 1)
            sessions = accept_followers(server, secret, multihost.num_processes, timeout_s, handshake_timeout_s)
        return cls(sessions, multihost)

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
        self._broadcast(encode_frame(seq, op, args), f"step {seq}")
        return seq

    def _broadcast(self, frame: Frame, what: str) -> None:
        """`frame` to every follower, each with its own MAC; FollowerLost if a send fails."""
        failure = None
        with self._send_lock:
            for pid, session in self._sessions.items():
                try:
                    session.sock.sendall(frame.packed(session.key))
                except OSError as err:
                    failure = failure or FollowerLost(f"follower {pid}: sending {what} failed ({err!r})")
            self._last_sent = time.monotonic()
        if failure is not None:
            self._lose(failure)
            raise failure

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

    def _match_tokens(self, seq: int, leader_tokens=None, follower_digest: tuple[int, str] | None = None) -> None:
        """Check every follower's (pid, digest) of step `seq`'s tokens against the leader's tokens,
        whichever arrives first; the entry is dropped once all followers have been checked."""
        with self._lock:
            tokens, digests, checked = self._tokens.get(seq, (None, [], 0))
            tokens = tokens if leader_tokens is None else leader_tokens
            digests = digests if follower_digest is None else [*digests, follower_digest]
            if tokens is None or not digests:
                self._tokens[seq] = (tokens, digests, checked)
                return
            checked += len(digests)
            if checked >= len(self._sessions):
                del self._tokens[seq]
            else:
                self._tokens[seq] = (tokens, [], checked)
        self._checker.submit(self._check_tokens, seq, tokens, digests)  # off the engine thread: it waits on the device

    def _check_tokens(self, seq: int, tokens, digests: list[tuple[int, str]]) -> None:
        tokens = np.asarray(tokens)
        for pid, theirs in digests:
            if not hmac.compare_digest(theirs.encode(), tokens_digest(self._sessions[pid].key, seq, tokens).encode()):
                self._lose(DivergenceError(f"step {seq}: follower {pid} sampled other tokens than the leader"))

    # -- liveness --
    def _read(self, pid: int, stream) -> None:
        reason = f"follower process {pid} closed its step channel (it died or exited)"
        try:
            for line in stream:
                self._last_seen[pid] = time.monotonic()
                message = json.loads(line)
                if isinstance(message, dict) and "tokens" in message:
                    seq, digest = message.get("seq"), message["tokens"]
                    if type(seq) is not int or not isinstance(digest, str):
                        raise ValueError(f"malformed token reply {line[:80]!r}")
                    self._match_tokens(seq, follower_digest=(pid, digest))
        except (OSError, ValueError) as err:
            reason = f"follower {pid}'s step channel failed: {err}"
        if not self._stopping:
            self._lose(FollowerLost(reason))

    def _beat(self) -> None:
        """An "hb" frame whenever nothing else went out for HEARTBEAT_S: followers time out on silence."""
        while not self._done.wait(HEARTBEAT_S / 2):
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                try:
                    self._broadcast(encode_frame(self._seq, HEARTBEAT, {}), "a heartbeat")
                except FollowerLost:
                    return

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            now = time.monotonic()
            for pid, seen in self._last_seen.items():
                if now - seen > self.heartbeat_timeout_s:
                    self._lose(FollowerLost(f"follower {pid} silent for {now - seen:.1f} s"))
            started = self._call_started
            if started is not None and now - started[1] > self.step_timeout_s:
                self._lose(
                    FollowerLost(
                        f"step {started[0]} has run for {now - started[1]:.0f} s "
                        f"(step_timeout_s={self.step_timeout_s:g})"
                    )
                )

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
        self.stop()
        import jax

        jax.distributed.shutdown()

    def stop(self) -> None:
        """Send every follower the stop frame (they leave with exit code 0) and stop the threads."""
        self._stopping = True
        self._done.set()
        try:
            self._broadcast(encode_frame(self._seq + 1, "stop", {}), "the stop frame")
        except FollowerLost as err:
            log.warning("stop frame not delivered: %s", err)


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
        self._send_lock = threading.Lock()

    def follow(self) -> int:
        """Connect, replay steps until the stop frame, then leave the distributed runtime and
        return 0. Leader gone or silent (1), a failed step (2), divergence (3), a failed handshake
        (4): close the channel (the leader's watchdog sees it at once) and exit without the
        shutdown barrier."""
        pid = self.multihost.process_id
        try:
            session = self.connect()
        except (HandshakeError, OSError) as err:
            code = EXIT_REFUSED if isinstance(err, HandshakeError) else EXIT_LEADER_LOST
            log.critical("process %d cannot join process 0's step channel: %s; exit code %d", pid, err, code)
            logging.shutdown()
            os._exit(code)
        threading.Thread(target=self._heartbeat, args=(session.sock,), name="jaxserve-heartbeat", daemon=True).start()
        code = self.replay(session)
        log.info("follower %d: %d steps replayed, exit code %d", pid, self.steps, code)
        if code != 0:
            session.sock.close()
            logging.shutdown()
            os._exit(code)
        import jax

        jax.distributed.shutdown()
        return 0

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> Session:
        """Dial the leader's step channel until it answers (it compiles first) and authenticate
        both ways. HandshakeError: the peer is not this launch's leader, or it refused us."""
        secret = channel_secret(self.multihost)
        host, port = step_address(self.multihost)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            configure(sock)
            try:
                session = follower_handshake(sock, secret, self.multihost.process_id)
                break
            except HandshakeError:
                sock.close()
                raise
            except OSError as err:  # closed or timed out mid-handshake (a busy leader): dial again
                sock.close()
                if time.monotonic() > deadline:
                    raise
                log.warning(
                    "follower %d: handshake with %s:%d failed (%s); retrying",
                    self.multihost.process_id,
                    host,
                    port,
                    err,
                )
                time.sleep(0.5)
        sock.settimeout(timeout_s)  # until the first frame: the leader may still wait for other followers
        log.info("follower %d joined the leader at %s:%d", self.multihost.process_id, host, port)
        return session

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

    def replay(self, session: Session) -> int:
        """Run the leader's steps until its stop frame (0); the exit code of what ended it otherwise."""
        pid = self.multihost.process_id
        try:
            return self._replay(session)
        except DivergenceError as err:
            log.critical("process %d diverged from the leader: %s", pid, err)
            return EXIT_DIVERGED
        except LeaderLost as err:
            log.critical("process %d lost the leader: %s", pid, err)
            return EXIT_LEADER_LOST
        except Exception:
            log.critical("process %d: step %d failed", pid, self.steps, exc_info=True)
            return EXIT_FAILED

    def _replay(self, session: Session) -> int:
        while True:
            try:
                frame = read_frame(session.sock)
            except TimeoutError:
                raise LeaderLost(f"no frame or heartbeat from the leader for {session.sock.gettimeout():g} s") from None
            except OSError as err:
                raise LeaderLost(f"the step channel failed: {err!r}") from err
            if frame is None:
                raise LeaderLost("the leader closed the step channel")
            session.sock.settimeout(self.multihost.heartbeat_timeout_s)  # the leader now beats every HEARTBEAT_S
            op, args = decode_frame(*frame, expected_seq=self.steps + 1, key=session.key)
            if op == HEARTBEAT:
                continue
            self.steps += 1
            if op == "stop":
                return 0
            if op not in STEP_METHODS:
                raise DivergenceError(f"step {self.steps}: unknown operation {op!r}")
            tokens = _tokens_of(op, self.run(op, args))
            if tokens is None:
                continue
            try:
                self._send(session.sock, {"seq": self.steps, "tokens": tokens_digest(session.key, self.steps, tokens)})
            except OSError as err:
                raise LeaderLost(f"replying to step {self.steps} failed: {err!r}") from err

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
