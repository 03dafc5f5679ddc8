"""DeviceUpload: a stored range read into a device tensor through two pinned host buffers.

Why: a device destination used to take its bytes through a fresh pageable host tensor per
stored chunk, read whole, then copied over with a blocking pageable copy: the file reads and
the transfers ran one after the other, the transfer at pageable rates (a 15 GB rank loaded in
~10 s on one H200). Here the file is read in pieces into one pinned buffer while the device
copies the other's previous piece (`non_blocking` from pinned memory runs at the link's rate).
A buffer is read into again only after the copy that reads it has finished (its event), and
`finish()` waits for the last copies before the destinations are used.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from tenax.checkpoint.tensor_bytes import byte_view

logger = logging.getLogger(__name__)

PIECE_BYTES = 32 << 20  # per buffer: large transfers; 64 MiB of pinned memory per reading thread


class DeviceUpload:
    """Two pinned buffers, the copy reading each (its event), used in turn."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        self.piece_bytes = piece_bytes
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = [None, None]
        self.turn = 0
        self.uploaded = 0

    def read_into(self, files: Any, file: str, offset: int, target: torch.Tensor) -> None:
        """Fill the contiguous device tensor `target` with the bytes of `file` from `offset`
        (`files`: a LocalChunkReader); the copies are queued on the current stream."""
        flat = target.reshape(-1).view(torch.uint8)
        total = flat.numel()
        if not self.buffers:
            self.buffers = [torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True)
                            for _ in range(2)]
        done = 0
        while done < total:
            n = min(self.piece_bytes, total - done)
            i = self.turn
            if self.events[i] is not None:
                self.events[i].synchronize()  # the copy out of this buffer has finished
            host = self.buffers[i][:n]
            files.read_into(file, offset + done, byte_view(host))
            flat[done:done + n].copy_(host, non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record(torch.cuda.current_stream(target.device))
            self.turn, done = 1 - i, done + n
        self.uploaded += total

    def finish(self) -> None:
        """Wait until every queued copy has landed (then the pinned buffers may go)."""
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.events = [None, None]
        if self.uploaded:
            logger.debug("uploaded %d bytes through pinned buffers", self.uploaded)
