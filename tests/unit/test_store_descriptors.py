"""The embedded store out of file descriptors (issue 26; found by benchmarks/coordination_scale.py): a node has
three connections to worker-0's store, so 1 024 nodes need over 3 000 descriptors in worker-0's runtime, above
the 1 024 soft limit some container runtimes give. The store must neither spin nor flood its log while a peer
waits in the listen backlog, and must serve that peer once a descriptor is free again.

The server runs in a child process whose RLIMIT_NOFILE soft limit is small; the peers are this process's. No timed
assertion: the bounds only guard against a hang."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from ma_runtime.coordination.embedded import EmbeddedStoreClient

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 48  # the child's soft limit: its interpreter and the server use a dozen; the rest are peers
PEERS = 80  # more than it can accept

SERVER = r"""
import json, resource, sys, time
from ma_runtime.coordination.embedded import EmbeddedStoreServer

class Log:
    warnings = 0
    def warning(self, message, **fields):
        Log.warnings += 1

resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
server = EmbeddedStoreServer("127.0.0.1", 0, log=Log()).start()
print(json.dumps({"port": server.port}), flush=True)
for line in sys.stdin:  # each line asks: how many warnings so far
    print(json.dumps({"warnings": Log.warnings}), flush=True)
server.close()
"""


def _child_environment():
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _ask(server: subprocess.Popen) -> dict:
    server.stdin.write("?\n")
    server.stdin.flush()
    return json.loads(server.stdout.readline())


def test_a_store_out_of_descriptors_waits_for_one_without_spinning_and_then_serves_the_waiting_peer():
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(LIMIT)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_child_environment())
    peers = []
    try:
        port = json.loads(server.stdout.readline())["port"]
        # Each connect completes in the kernel's backlog; the store accepts what its descriptors allow.
        peers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(PEERS)]
        # Give the store's loop many turns with a peer it cannot accept: a spinning loop warns on each.
        for _ in range(20):
            warnings = _ask(server)["warnings"]
        client = EmbeddedStoreClient("127.0.0.1", port, reconnect_seconds=10, reply_seconds=10)
        assert warnings <= 3, f"{warnings} warnings: the store retried accept() in a loop while out of descriptors"
        for peer in peers:
            peer.close()
        peers = []
        assert client.get("k") is None  # the waiting peer is served once descriptors are free
        client.close()
    finally:
        for peer in peers:
            peer.close()
        server.stdin.close()
        server.wait(30)
