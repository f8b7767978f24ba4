"""The embedded store: the server worker-0's runtime hosts on a thread, and the client every node's runtime uses.

As torch c10d hosts its TCPStore on node 0, worker-0 (VC_TASK_INDEX=0) hosts the job's store itself: nothing the
platform does not already give, pod-to-pod TCP and the job's DNS names. Standard library only.

Server. One thread, one `selectors` loop: 1 000 clients are 1 000 sockets, not 1 000 threads. Every operation is
applied on that thread in the order the requests arrive (the store's receive order, store.py). A `wait` is parked
on the keys it waits for and answered by the write that completes it or by its deadline, never polled; keys with a
time to live expire on the server's monotonic clock. `close()` stops the loop, closes every socket and joins the
thread.

Protocol. Each message is a frame: 4 bytes big-endian length, then that many bytes of a UTF-8 JSON object. A
request is {"op", "n" (the client's request number), "s" (the client's session, random), ...the operation's
fields}, values in base64; the reply is {"n", "r": result} or {"n", "e": "why it was refused"}. A frame longer than
FRAME_LIMIT, or one that is not such a request, closes that connection only: a broken or hostile peer cannot make
the server allocate more than FRAME_LIMIT for it, nor disturb the others; nor can a peer that never reads its
replies (its connection is closed once OUTPUT_LIMIT bytes wait for it). All the values together are bounded too
(`byte_limit`): a write past it is refused.

Client. One TCP connection, one request at a time (a lock). When the connection is lost the client connects again
and resends the request until `reconnect_seconds` after the loss, then raises StoreUnavailable naming host:port.
A resent write is applied once: the server keeps each session's last write reply and answers a repeated request
number with it (so `add` never counts twice, and the winner of `compare_and_set` still reads True).

Trust model (the mpirun key server's, docs/platform.md D38, made stricter). Who may talk to the store: the job's
own nodes. The server calls `allow(peer_ip)` for each connection before reading a byte of it; the runtime passes
the job's node addresses (VC_WORKER_HOSTS resolved by the cluster's DNS, the trust the pod network already
gives), and a refused peer is closed at once and logged by its address only. There is no secret on the wire, so
none to steal or to leak: the store holds the job's coordination (who joined, which attempt, who failed first,
heartbeats), never credentials or the job's environment, and the runtime puts nothing else there. Values are never
logged, by the server or the client. What this does not stop: a process inside an allowed pod (that pod is the
job's own), or a peer that spoofs an allowed address on the pod network (the cluster's network policy is the
boundary, as for sshd and torchrun's TCPStore, which has no check at all). Plain TCP, no TLS, like TCPStore.

The package: frames.py (the wire format and its limits), table.py (the state and the requests applied to it, no
I/O), server.py (the selectors loop, connections, the allow hook), client.py. Its public surface is re-exported
here: the server, the client, the allow hook, the frame format and its limits.
"""

from ma_runtime.coordination.embedded.client import EmbeddedStoreClient
from ma_runtime.coordination.embedded.frames import (
    FRAME_LIMIT,
    OUTPUT_LIMIT,
    VALUE_LIMIT,
    FrameError,
    FrameReader,
    address_text,
    encode_frame,
)
from ma_runtime.coordination.embedded.server import EmbeddedStoreServer, allow_addresses

__all__ = ["FRAME_LIMIT", "OUTPUT_LIMIT", "VALUE_LIMIT", "EmbeddedStoreClient", "EmbeddedStoreServer", "FrameError",
           "FrameReader", "address_text", "allow_addresses", "encode_frame"]
