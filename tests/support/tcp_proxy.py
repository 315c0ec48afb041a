"""A TCP proxy on 127.0.0.1 that a test switches off and on: the fault of a server that went away
(every connection reset, new ones refused) and came back on the same address — at once and
as often as the test says, which killing and restarting the real server (seconds to start,
its port free meanwhile) cannot do. Bytes pass through untouched (HTTP, websockets)."""

from __future__ import annotations

import select
import socket
import threading
from contextlib import suppress


class SwitchableProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; :meth:`down` / :meth:`up` switch it."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener: socket.socket | None = None
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.port = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        """Listen (again, on the same port) and forward every connection."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="proxy-accept").start()

    def down(self) -> None:
        """Refuse new connections and reset the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            live, self._live = self._live, set()
        for s in live:
            with suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()

    close = down

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # switched off
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._live |= {client, server}
            threading.Thread(target=self._pump, args=(client, server), daemon=True, name="proxy-pump").start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                ready, _, _ = select.select(list(peers), [], [], 1.0)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except (OSError, ValueError):
            return  # reset by down(), or closed by either side
        finally:
            with self._lock:
                self._live -= {a, b}
            for s in (a, b):
                with suppress(OSError):
                    s.close()
