"""read_pieces: byte ranges of local files read straight into their destinations by several
threads at once (a device destination through each thread's own pinned buffers).

Why: a rank's state is one file (a 1.26B model with AdamW: 15 GB), and one reader thread moved
it at ~3 GB/s from the page cache on an H200 host while the node's other cores idled; `pread`
and the copies release the GIL, so threads scale until the memory bus is the limit. Each
destination is cut into pieces of at most PIECE_BYTES so one large tensor spreads over every
thread, and the pieces are dealt out largest-load-first so the threads finish together.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tenax.checkpoint.format.split_crc import io_threads
from tenax.checkpoint.load.device_upload import DeviceUpload
from tenax.checkpoint.tensor_bytes import byte_view

logger = logging.getLogger(__name__)

PIECE_BYTES = 256 << 20

Piece = tuple[str, int, torch.Tensor]  # (file, offset, contiguous destination)


def read_pieces(files: Any, pieces: list[Piece], threads: int | None = None) -> None:
    """Fill every destination with the bytes of its file from its offset (`files`: a
    LocalChunkReader whose files are opened already, so threads never open one twice)."""
    jobs: list[Piece] = []
    for file, offset, target in pieces:
        flat = target.reshape(-1).view(torch.uint8)
        for lo in range(0, flat.numel(), PIECE_BYTES):
            jobs.append((file, offset + lo, flat[lo:lo + PIECE_BYTES]))
    lanes = _deal(jobs, threads or io_threads())
    if len(lanes) <= 1:
        _read_lane(files, jobs)
        return
    with ThreadPoolExecutor(len(lanes), thread_name_prefix="tenax-load") as pool:
        for done in [pool.submit(_read_lane, files, lane) for lane in lanes]:
            done.result()  # the first failure raises, after every lane has stopped


def _deal(jobs: list[Piece], threads: int) -> list[list[Piece]]:
    """The jobs in `threads` lanes of about equal bytes (largest first, to the lightest)."""
    lanes: list[list[Piece]] = [[] for _ in range(max(1, min(threads, len(jobs))))]
    loads = [0] * len(lanes)
    for job in sorted(jobs, key=lambda j: -j[2].numel()):
        lightest = loads.index(min(loads))
        lanes[lightest].append(job)
        loads[lightest] += job[2].numel()
    return [lane for lane in lanes if lane]


def _read_lane(files: Any, lane: list[Piece]) -> None:
    upload = DeviceUpload()
    try:
        for file, offset, flat in lane:
            if flat.device.type == "cpu":
                files.read_into(file, offset, byte_view(flat))
                continue
            with torch.cuda.device(flat.device):  # a new thread's current device is 0
                upload.read_into(files, file, offset, flat)
    finally:
        upload.finish()  # no pinned buffer goes while a copy still reads it
