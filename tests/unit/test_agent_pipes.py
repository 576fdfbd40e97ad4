"""A host agent closes a proc's output pipes through the file objects that own them (a bare
``os.close`` left the file object to close the number again when collected: by then another
pipe's, e.g. a new fork's, which then failed with EBADF)."""

from __future__ import annotations

import gc
import os

from monarch_nb.runtime.forkserver import ForkedProc
from monarch_nb.runtime.host_agent import ChildProc, _close_pipe


def _forked() -> tuple[ForkedProc, list[int]]:
    fds = [os.pipe() for _ in range(3)]
    proc = ForkedProc(12345, os.fdopen(fds[0][1], "wb", buffering=0), os.fdopen(fds[1][0], "rb", buffering=0),
                      os.fdopen(fds[2][0], "rb", buffering=0))
    for r, w in fds:  # the ends a proc would hold
        os.close(w if (r, w) != fds[0] else r)
    return proc, [proc.stdout.fileno(), proc.stderr.fileno()]


def test_a_closed_output_pipe_stays_closed_once_and_a_reused_number_survives_collection():
    proc, (out_fd, err_fd) = _forked()
    child = ChildProc("pm0.1", 1, proc, "pm0", fds={out_fd: "stdout", err_fd: "stderr"})
    for fd in (out_fd, err_fd):
        _close_pipe(child, fd)
    assert proc.stdout.closed and proc.stderr.closed
    proc.stdin.close()
    reused = os.pipe()  # most likely the numbers just freed
    try:
        del child, proc
        gc.collect()
        for fd in reused:
            os.fstat(fd)  # raises EBADF if a collected file object closed it
    finally:
        for fd in reused:
            os.close(fd)
