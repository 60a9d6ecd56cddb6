"""The follower of multi-process serving (processes 1..N-1), and the replay protocol both ends share.

    code = Follower(engine, config.parallel.multihost).follow()   # no HTTP; the exit code

A follower replays, in order, every executable-table call the leader (runtime/parallel/multihost.py)
sends: `STEP_METHODS` names the table's public `run_*` / `copy_states` methods that travel and their
arguments; those in `DEVICE_ARGS` are each process's own device arrays (its params, caches, request
table and last hidden states), the rest are the host values in the frame. A process's table
compiles what it runs through its own `compile(key)`, as the leader's does. Exit codes: 0 after the
leader's stop frame, 1 leader lost or silent, 2 a failed step, 3 divergence, 4 a refused handshake.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time

import numpy as np

from runtime.parallel.multihost_channel import (
    HEARTBEAT,
    DivergenceError,
    HandshakeError,
    Session,
    channel_secret,
    configure,
    decode_frame,
    follower_handshake,
    read_frame,
    step_address,
    tokens_digest,
)
from runtime.steps.programs import TokenFeed

log = logging.getLogger("jaxserve.multihost")

HEARTBEAT_S = 0.5
CONNECT_TIMEOUT_S = 600.0  # followers wait this long for the leader's step channel (it compiles first)
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


class LeaderLost(ConnectionError):
    """The leader closed the step channel, went silent, or stopped reading."""


def tokens_of(method: str, result):
    """The sampled tokens in `method`'s result (None: the call samples none)."""
    if method == "run_greedy_backbone":
        return result[1]
    if method == "run_table_greedy_backbone":
        return result[2]
    if method == "run_sampler":
        return result.tokens
    return None


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
            tokens = tokens_of(op, self.run(op, args))
            if tokens is None:
                continue
            try:
                self._send(session.sock, {"seq": self.steps, "tokens": tokens_digest(session.key, self.steps, tokens)})
            except OSError as err:
                raise LeaderLost(f"replying to step {self.steps} failed: {err!r}") from err

    def _prev_tokens(self):
        if self.last_tokens is not None:
            return self.last_tokens
        return np.zeros(self.engine.executables.max_num_seqs, np.int32)  # a step after none, as the engine's

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
        tokens = tokens_of(op, result)
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
