"""The channel's receive loop: readers added from another thread while a thread leads."""

from __future__ import annotations

import os
import threading

from monarch_nb.transport.channel import Channel
from monarch_nb.transport.wire import Signer


def test_a_reader_added_while_the_io_thread_makes_its_poller_is_polled_in_that_same_lead():
    # Another thread's add_reader lands right after the leading IO thread made its poller (forced
    # here by adding it from inside _poller): the loop must see the readers changed and poll the
    # new fd in this lead. The IO thread leads alone here (no caller wants the lease), so a reader
    # it missed would not fire until some other thread took the lease: never, in this test.
    channel = Channel("test-reader-race", Signer(b"k" * 32), lambda *args: None)
    read_fd, write_fd = os.pipe()
    fired, added = threading.Event(), threading.Event()
    make_poller = channel._poller

    def poller_then_reader_added():
        poller = make_poller()
        if not added.is_set() and threading.current_thread() is channel._thread:
            channel.add_reader(read_fd, lambda fd: (os.read(fd, 100), fired.set()))
            added.set()
        return poller

    channel._poller = poller_then_reader_added  # type: ignore[method-assign]
    try:
        channel.start()
        assert added.wait(5.0), "the IO thread did not lead within 5 s"
        os.write(write_fd, b"x")
        assert fired.wait(2.0), "the reader added while the poller was made never fired"
    finally:
        channel.close()
        os.close(read_fd)
        os.close(write_fd)
