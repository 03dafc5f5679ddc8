"""Joining a process group: a rank that arrives before rank 0's store waits for it by polling
(torch's own retry backs off ~0.3-0.5 s, paid on every warm recovery)."""
from __future__ import annotations

import socket
import threading
import time

from tenax.workers.rendezvous import free_port, wait_for_store


def test_wait_for_store_gives_up_when_nothing_listens():
    assert wait_for_store("127.0.0.1", free_port(), 0.2) is False


def test_wait_for_store_returns_once_the_store_opens():
    port = free_port()
    opened = threading.Event()
    server = socket.socket()

    def open_later() -> None:
        time.sleep(0.1)
        server.bind(("127.0.0.1", port))
        server.listen()
        opened.set()

    thread = threading.Thread(target=open_later)
    thread.start()
    try:
        assert wait_for_store("127.0.0.1", port, 30.0) is True
        assert opened.is_set()  # it returned because the store opened, not before
    finally:
        thread.join()
        server.close()
