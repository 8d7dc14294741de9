"""Throw-away Redis/Valkey servers on loopback, for the tests, the benchmark and the simulator.

It starts server processes, so it lives in :mod:`statecore.services`, outside the sans-IO core.

:class:`LocalRedis` runs one ``redis-server`` (or ``valkey-server``) process on
``127.0.0.1``, on a free port, with its own temporary data directory and no persistence; it
can be stopped and started again on the same port (a restart loses the data, as a server
without persistence does). :class:`LocalRedisCluster` runs three such processes in cluster
mode and joins them into one cluster (every node a primary, the 16384 hash slots split
evenly) with plain cluster commands, so no ``redis-cli`` is needed.

The server binary is looked up on ``PATH`` (``redis-server`` first, then ``valkey-server``),
or taken from ``STATECORE_REDIS_SERVER``. ``scripts/test.sh`` installs Debian's
``redis-server`` when it is missing (see ``scripts/_system.sh``). :func:`find_server` returns
``None`` when there is none, so callers can say why they cannot run.

Starting waits (polling ``PING``, bounded) until the server answers; it is setup, not a test
of timing.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["LocalRedis", "LocalRedisCluster", "find_server"]

_START_TIMEOUT_S = 20.0


def find_server() -> str | None:
    """The server binary: ``$STATECORE_REDIS_SERVER``, ``redis-server`` or ``valkey-server``."""
    env = os.environ.get("STATECORE_REDIS_SERVER")
    if env:
        return env if shutil.which(env) else None
    return shutil.which("redis-server") or shutil.which("valkey-server")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one at most 55535 whose bus port (+10000) is
    free too."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 55535)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node on 127.0.0.1")


class LocalRedis:
    """One server process on ``127.0.0.1`` (module docstring).

    Args:
        maxmemory: the server's ``maxmemory`` in bytes (0: no limit).
        policy: its ``maxmemory-policy`` (e.g. ``allkeys-lru``, ``noeviction``).
        cluster: start the node in cluster mode (for :class:`LocalRedisCluster`).
        binary: the server binary (default :func:`find_server`).
    """

    def __init__(
        self,
        maxmemory: int = 0,
        policy: str = "allkeys-lru",
        cluster: bool = False,
        binary: str | None = None,
    ) -> None:
        found = binary or find_server()
        if found is None:
            raise FileNotFoundError(
                "no redis-server or valkey-server on PATH (scripts/test.sh installs Debian's "
                "redis-server; or set STATECORE_REDIS_SERVER)"
            )
        self.binary = found
        self.maxmemory = maxmemory
        self.policy = policy
        self.cluster = cluster
        self.port = _free_port(cluster)
        self.dir = Path(tempfile.mkdtemp(prefix="statecore-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            self.policy,
            "--logfile",
            str(self.dir / "server.log"),
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
        return args

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.Redis`` client of this server."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self) -> LocalRedis:
        """Start the process (on the same port as before, when restarted) and wait for PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.cluster:
            with contextlib.suppress(OSError):
                (self.dir / "nodes.conf").unlink()
        for attempt in range(5):
            self.proc = subprocess.Popen(
                self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            if self._wait_ready():
                return self
            exited = self.proc is not None and self.proc.poll() is not None
            self._kill()
            if exited and attempt < 4:
                self.port = _free_port(self.cluster)  # the port was taken meanwhile
        log = (self.dir / "server.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.binary} did not start on port {self.port}: {log}")

    def _wait_ready(self) -> bool:
        import redis

        deadline = time.monotonic() + _START_TIMEOUT_S
        c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if c.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            c.close()

    def _kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None

    def stop(self) -> None:
        """Stop the process (its data is lost; the port and directory are kept)."""
        self._kill()

    @property
    def running(self) -> bool:
        """Whether the process is up."""
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Stop the process and remove the data directory."""
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRedisCluster:
    """Three (or ``nodes``) cluster-mode servers on loopback, joined into one cluster."""

    def __init__(self, nodes: int = 3, maxmemory: int = 0, policy: str = "allkeys-lru") -> None:
        self.nodes = [LocalRedis(maxmemory, policy, cluster=True) for _ in range(nodes)]

    @property
    def url(self) -> str:
        """A URL of one node (the cluster client discovers the others)."""
        return self.nodes[0].url

    def start(self) -> LocalRedisCluster:
        """Start the nodes, assign the slots, introduce the nodes, wait for ``cluster_state:ok``."""
        import redis

        for node in self.nodes:
            node.start()
        n = len(self.nodes)
        clients = [node.client(socket_timeout=5.0) for node in self.nodes]
        try:
            for i, c in enumerate(clients):
                lo, hi = 16384 * i // n, 16384 * (i + 1) // n - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + _START_TIMEOUT_S
            while True:
                ok = True
                for c in clients:
                    info = c.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    if "cluster_state:ok" not in text or f"cluster_known_nodes:{n}" not in text:
                        ok = False
                        break
                if ok:
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError("the local Redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except redis.RedisError:
            self.close()
            raise
        finally:
            for c in clients:
                c.close()

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
