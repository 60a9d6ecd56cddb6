"""Multi-process serving: process 0 (the leader) schedules and serves HTTP; every other process
(a follower) replays the leader's executable calls, in the same order, with the same host inputs.

    channel = LeaderChannel()                                          # process 0
    engine = LLMEngine(config, wrap_executables=channel.wrap)          # built with its executables wrapped
    channel.connect(MultihostLeader.listen(config.parallel.multihost))  # after the (collective) load
    channel.serve(async_engine)    # a lost follower marks the engine dead; its shutdown stops them
    ...
    Follower(engine, config.parallel.multihost).follow()   # processes 1..N-1: runtime/parallel/follower.py

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from models.batch import ForwardBatch
from runtime.parallel.follower import (
    CONNECT_TIMEOUT_S,
    DEVICE_ARGS,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_LEADER_LOST,
    EXIT_REFUSED,
    HEARTBEAT_S,
    OWN_IF_ON_DEVICE,
    STEP_METHODS,
    Follower,
    LeaderLost,
    tokens_of,
)
from runtime.parallel.multihost_channel import (
    HANDSHAKE_TIMEOUT_S,
    HEARTBEAT,
    DivergenceError,
    Frame,
    Session,
    accept_followers,
    channel_secret,
    encode_frame,
    step_address,
    step_bind_address,
    tokens_digest,
)

log = logging.getLogger("jaxserve.multihost")

__all__ = [  # the follower's side lives in runtime/parallel/follower.py; both are imported from here
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_LEADER_LOST",
    "EXIT_REFUSED",
    "DivergenceError",
    "Follower",
    "FollowerLost",
    "LeaderChannel",
    "LeaderExecutables",
    "LeaderLost",
    "MultihostLeader",
    "step_address",
]

SEND_TIMEOUT_S = 30.0  # a follower that has not read for this long is lost


class FollowerLost(RuntimeError):
    """A follower process died, went silent, or a step stopped making progress."""


def _on_host(value) -> bool:
    """A numpy value (or a ForwardBatch of them) that the leader sends as it is."""
    return isinstance(value.input_ids if isinstance(value, ForwardBatch) else value, (np.ndarray, np.generic))


# ---- leader -------------------------------------------------------------------------------------
class LeaderExecutables:
    """The leader's `StepExecutables`, each step method first sent to every follower."""

    def __init__(self, inner, leader: MultihostLeader | LeaderChannel):
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
            tokens = tokens_of(name, result)
            if tokens is not None:
                self._leader.expect_tokens(seq, tokens)
            return result

        return broadcast_then_call


class LeaderChannel:
    """The leader as the engine is built: its executables are wrapped at construction
    (`LLMEngine(wrap_executables=channel.wrap)`), while the followers connect only after the
    collective load (`connect`). No step runs in between: a multi-process engine skips its lone
    warm-up step, and a call before `connect` raises FollowerLost."""

    def __init__(self):
        self.leader: MultihostLeader | None = None

    def wrap(self, executables) -> LeaderExecutables:
        return LeaderExecutables(executables, self)

    def connect(self, leader: MultihostLeader) -> MultihostLeader:
        self.leader = leader
        return leader

    def serve(self, client) -> None:
        self._connected().serve(client)

    def _connected(self) -> MultihostLeader:
        if self.leader is None:
            raise FollowerLost("the step channel is not connected yet (a step ran before the followers joined)")
        return self.leader

    def send(self, op: str, args: dict) -> int:
        return self._connected().send(op, args)

    def running(self, seq: int):
        return self._connected().running(seq)

    def expect_tokens(self, seq: int, tokens) -> None:
        self._connected().expect_tokens(seq, tokens)


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

    def serve(self, client) -> None:
        """Serve through `client` (an AsyncEngine whose engine was built with this leader's
        `LeaderExecutables`): mark it dead when a follower is lost, stop the followers when it
        shuts down."""
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
