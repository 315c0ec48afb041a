"""A pseudo-terminal for a child process's output, as a user's terminal would show it."""

from __future__ import annotations

import os
import pty
import re
import threading

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """Give ``child`` as the process's stdout/stderr (then :meth:`opened`); what it writes is read
    as it comes by a thread — a terminal nobody reads fills up and blocks the writer."""

    def __init__(self) -> None:
        self.fd, self.child = pty.openpty()
        self.seen = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def opened(self) -> Terminal:
        """The child process has its end: close ours of it and start reading."""
        os.close(self.child)
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # every writer closed its end
                return
            if not chunk:
                return
            self.seen += chunk

    def text(self) -> str:
        """What it showed so far, without colour and cursor codes."""
        return ANSI.sub("", bytes(self.seen).decode(errors="replace"))

    def close(self, wait_s: float = 10) -> None:
        self._reader.join(wait_s)
        os.close(self.fd)
