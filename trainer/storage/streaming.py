"""Feed a consumer from a producer without a temporary file: ``write`` fills a pipe on a thread
while ``consume`` reads it in the calling thread (for S3: ``torch.save`` → multipart upload).

All-or-nothing: if the producer fails, the reader raises instead of reporting end-of-stream,
so the consumer never takes a truncated stream for a complete one (boto3 then aborts the
multipart upload); if the consumer fails, the producer's next write fails and the thread ends.
"""

from __future__ import annotations

import fcntl
import io
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

PIPE_BYTES = 1 << 20  # a larger kernel pipe buffer: fewer wake-ups per MiB


class ProducerFailed(RuntimeError):
    """The producer raised; the consumer saw this instead of end-of-stream."""


class _Reader(io.RawIOBase):
    def __init__(self, fd: int, failure: list[BaseException]):
        self.fd, self.failure = fd, failure

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = os.readv(self.fd, [buf])
        if n == 0 and self.failure:  # the writer closed its end because it failed
            raise ProducerFailed("the data producer failed") from self.failure[0]
        return n


def pipe_to(write: Callable[[BinaryIO], None], consume: Callable[[BinaryIO], object]) -> object:
    """``consume(reader)`` while ``write(writer)`` runs on a thread; returns what consume returns.
    Re-raises the producer's own exception if it failed, else the consumer's."""
    rfd, wfd = os.pipe()
    try:
        fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer works
        pass
    failure: list[BaseException] = []

    def produce() -> None:
        w = open(wfd, "wb", buffering=PIPE_BYTES, closefd=True)  # buffered: full writes
        try:
            write(w)
            w.flush()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's side
            failure.append(exc)  # before the close below: the reader must never see a clean EOF
        finally:
            try:
                w.close()
            except BaseException as exc:  # noqa: BLE001
                if not failure:
                    failure.append(exc)

    thread = threading.Thread(target=produce, name="pipe-producer", daemon=True)
    thread.start()
    reader = io.BufferedReader(_Reader(rfd, failure), buffer_size=PIPE_BYTES)
    try:
        result = consume(reader)
    except BaseException:
        os.close(rfd)  # a producer blocked on a full pipe gets EPIPE and ends
        rfd = -1
        thread.join()
        if failure and not isinstance(failure[0], BrokenPipeError):
            raise failure[0] from None
        raise
    finally:
        if rfd >= 0:
            os.close(rfd)
    thread.join()
    if failure:  # the consumer stopped reading early but the producer failed: never a success
        raise failure[0]
    return result
