"""SIGTERM answered by a command of its own for as long as it runs (`tenax run`, `tenax data
prepare`): by default SIGTERM ends the process on the spot, before it can stop its workers or
remove a partial output."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

__all__ = ["handling_sigterm"]


@contextlib.contextmanager
def handling_sigterm(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """`handler` answers SIGTERM inside the block, the previous handler again after it. Off the
    main thread (tests run commands in threads) nothing changes: only it may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
