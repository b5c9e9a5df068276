"""HTTP/1.1 requests read off a raw socket, and a socket closed the way a killed process's is: for the
test servers that play a replica (tests/test_client.py, tests/serve/test_lost_replica_resend.py)."""

from __future__ import annotations

import socket
import struct


def read_head(conn: socket.socket) -> bytes | None:
    """A request's head up to its blank line (with whatever of the body came along); None if the peer
    closed the connection first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data


def read_request(conn: socket.socket, head: bytes) -> bytes:
    """The whole request whose head `read_head` returned: the body as long as its Content-Length."""
    header, body = head.split(b"\r\n\r\n", 1)
    length = next(
        (int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(body) < length:
        body += conn.recv(65536)
    return header + b"\r\n\r\n" + body


def reset(conn: socket.socket) -> None:
    """Make the coming close a reset (linger on, 0 s), as the kernel does for a killed process's socket."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
