"""A real Redis Cluster that a test starts itself: six ``redis-server
--cluster-enabled yes`` nodes on free loopback ports (3 primaries, 3 replicas),
joined with ``redis-cli --cluster create``; a primary can be killed and the
failover watched."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from reconcile_redis_server import RedisServer, free_port, need_binary

#: Milliseconds a node may be unreachable before replicas fail it over.  Low so
#: a test sees the failover in ~1-2 s; production clusters use 15000.
NODE_TIMEOUT_MS = 1000


class ClusterNode(RedisServer):
    """One cluster-enabled redis-server (its own directory and nodes.conf)."""

    def __init__(self, workdir: Path, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # The bus port defaults to port + 10000, which a free ephemeral port may
        # push past 65535: pick it explicitly.
        self.bus_port = free_port()
        super().__init__(
            workdir,
            extra=(
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(self.bus_port),
                "--cluster-config-file",
                str(workdir / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
                # A replica with any lag may still be promoted (the test measures
                # what a failover loses; it must not wait for a perfect replica).
                "--cluster-replica-validity-factor",
                "0",
            ),
        )


class RedisCluster:
    """``primaries`` primaries with one replica each, all on 127.0.0.1."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.cli = need_binary("redis-cli")
        self.nodes = [ClusterNode(workdir / f"node{i}") for i in range(2 * primaries)]
        self.primaries = primaries

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming every node as a seed."""
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{seeds}"

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        """Start and join every node; on any failure, stop the nodes started."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=timeout_s,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_ok(timeout_s)
        self.wait_replicas(timeout_s)
        return self

    def wait_replicas(self, timeout_s: float = 30.0) -> None:
        """Until every primary has a replica whose link is up and synced."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            synced = 0
            for node in self.live():
                role = node.client().execute_command("ROLE")
                if role[0] in (b"slave", "slave") and role[3] in (b"connected", "connected"):
                    synced += 1
            if synced >= self.primaries:
                return
            time.sleep(0.05)
        raise RuntimeError("replicas did not finish their initial sync")

    def wait_ok(self, timeout_s: float = 30.0) -> float:
        """Seconds until every live node reports ``cluster_state:ok`` and agrees on
        who owns every slot."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if all(self._ok(n) for n in self.live()):
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def _ok(self, node: ClusterNode) -> bool:
        try:
            info = node.client().execute_command("CLUSTER", "INFO")
        except Exception:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_ok:16384" in text

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def owner_of(self, key: str) -> ClusterNode:
        """The node that serves ``key``'s slot as a primary now."""
        probe = self.live()[0].client()
        slot = int(probe.execute_command("CLUSTER", "KEYSLOT", key))
        for start, end, primary, *_ in probe.execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                port = int(primary[1])
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no owner for slot {slot}")

    def replicas_of(self, node: ClusterNode) -> list[ClusterNode]:
        probe = node.client()
        my_id = probe.execute_command("CLUSTER", "MYID")
        my_id = my_id.decode() if isinstance(my_id, bytes) else my_id
        lines = probe.execute_command("CLUSTER", "REPLICAS", my_id)
        ports = set()
        for line in lines:
            text = line.decode() if isinstance(line, bytes) else line
            ports.add(int(text.split()[1].split("@")[0].rsplit(":", 1)[1]))
        return [n for n in self.nodes if n.port in ports]

    def client(self, **kw: Any) -> Any:
        import redis.cluster

        return redis.cluster.RedisCluster(
            host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5, **kw
        )

    def close(self) -> None:
        for node in self.nodes:
            node.close()


__all__ = ["ClusterNode", "RedisCluster", "free_port"]
