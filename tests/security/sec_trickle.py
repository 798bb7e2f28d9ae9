"""A hostile /metrics endpoint: listens on the given ports and answers every connection one byte
every 0.3 s, for ever (a status line, then a header that never ends). A per-read timeout never
fires against it; only a deadline for the whole scrape ends the wait.

Usage: sec_trickle.py PORT [PORT...]   (prints ``listening`` once every port is bound)
"""

from __future__ import annotations

import socket
import sys
import threading
import time

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Trickle: " + b"a" * 1_000_000


def trickle(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(5)
        try:
            conn.recv(4096)
            for byte in ANSWER:
                conn.sendall(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass  # the client gave up: what the test wants


def serve(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=trickle, args=(conn,), daemon=True).start()


def main(ports: list[int]) -> None:
    for port in ports:
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        threading.Thread(target=serve, args=(sock,), daemon=True).start()
    print("listening", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main([int(p) for p in sys.argv[1:]])
