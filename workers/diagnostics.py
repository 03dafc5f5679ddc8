"""Hang evidence: the Python stack of every thread of a training process, on request, and
which rank's stack differs from the others'.

Why faulthandler on a signal: a hung rank is usually stuck inside C (a gloo or NCCL collective,
a CUDA sync, a lock), where no Python code of ours runs. faulthandler's handler is C, runs in
the signal context and walks every thread's Python frames without taking the GIL, so it answers
even then. Each training process arms it at start (`arm_stack_dump`) on `STACK_SIGNAL`, into a
file named by its pid; its agent sends the signal and reads the file (`dump_stacks`). Nothing
runs in a healthy process until the signal comes.

`diagnose` groups ranks by the top frames of their training thread: in a hang the healthy
ranks wait in the same collective, and the rank that is elsewhere is the odd one out.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

logger = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR2
TOP_FRAMES = 3  # frames that make two stacks "the same place"
SETTLE_S = 0.05  # the file stopped growing this long: the dump is complete
_ARMED: list[TextIO] = []  # faulthandler keeps the fd; the file object must outlive the call
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) (?P<id>0x[0-9a-f]+)")
TRAINING_ENTRY = ("run_rank", "_child_main", "_rank_process")


def diagnostics_location(checkpoint_uri: str, cause: str, now: float | None = None) -> str:
    """`<checkpoint.uri>/diagnostics/<YYYYmmddTHHMMSS.mmmZ>-<cause>`: hang and straggler
    evidence, profiles. Milliseconds, because two profile requests (or two hangs) can come
    within one second and must not write into one directory."""
    now = time.time() if now is None else now
    millis = int(round(now * 1000))
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"
    return f"{checkpoint_uri.rstrip('/')}/diagnostics/{stamp}-{cause or 'failure'}"


def stack_file(pid: int) -> str:
    """Where training process `pid` writes its stacks (its agent shares the host)."""
    return os.path.join(tempfile.gettempdir(), f"tenax-stacks-{pid}.txt")


def arm_stack_dump() -> str:
    """In a training process: dump every thread's stack into `stack_file(pid)` on STACK_SIGNAL."""
    path = stack_file(os.getpid())
    file = open(path, "w")
    _ARMED.append(file)
    faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)
    return path


def forget_stacks(pid: int) -> None:
    """Remove a finished training process's stack file (its agent, once the process ended)."""
    try:
        os.unlink(stack_file(pid))
    except OSError:
        pass  # never armed, or already gone


def dump_stacks(pid: int, timeout_s: float = 2.0) -> str:
    """In the agent: signal training process `pid`, return what it dumped within timeout_s
    ("" when it wrote nothing: not armed, or already gone)."""
    path = stack_file(pid)
    try:
        before = os.path.getsize(path)
    except OSError:
        return ""
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return ""
    deadline, size, since = time.monotonic() + timeout_s, before, time.monotonic()
    while time.monotonic() < deadline:
        now = os.path.getsize(path)
        if now != size:
            size, since = now, time.monotonic()
        elif size > before and time.monotonic() - since >= SETTLE_S:
            break
        time.sleep(0.01)
    with open(path, "rb") as f:
        f.seek(before)
        return f.read().decode(errors="replace")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({os.path.basename(self.file)}:{self.line})"


@dataclass
class ThreadStack:
    thread: str
    frames: list[Frame] = field(default_factory=list)  # most recent call first
    current: bool = False  # the thread that ran the dump (the main thread, in practice)


def parse_stacks(text: str) -> list[ThreadStack]:
    """faulthandler's dump as threads and their frames."""
    threads: list[ThreadStack] = []
    for line in text.splitlines():
        head, frame = _THREAD.match(line), _FRAME.match(line)
        if head:
            threads.append(ThreadStack(head.group("id"), current=line.startswith("Current")))
        elif frame and threads:
            threads[-1].frames.append(Frame(frame.group("file"), int(frame.group("line")),
                                            frame.group("func")))
    return threads


def training_thread(text: str) -> ThreadStack | None:
    """The thread running the rank loop (its stack reaches `run_rank`), else the one that ran
    the dump (Python runs signal handlers on the main thread), else the last listed."""
    threads = parse_stacks(text)
    for thread in threads:
        if any(f.func in TRAINING_ENTRY for f in thread.frames):
            return thread
    current = [t for t in threads if t.current]
    return current[0] if current else threads[-1] if threads else None


@dataclass
class Diagnosis:
    groups: list[tuple[tuple[str, ...], list[int]]]  # (top frames, ranks), largest group first
    odd: list[int]  # ranks whose training thread is somewhere the others' is not

    def render(self) -> str:
        lines = []
        for frames, ranks in self.groups:
            lines.append(f"ranks {', '.join(map(str, ranks))} ({len(ranks)}):")
            lines += [f"    {frame}" for frame in frames] or ["    (no stack)"]
        if self.odd:
            lines.append("odd one out: " + ", ".join(f"rank {r}" for r in self.odd))
        else:
            lines.append("no odd one out: every rank is in the same place")
        return "\n".join(lines)


def diagnose(stacks: dict[int, str], top: int = TOP_FRAMES) -> Diagnosis:
    """Group ranks by their training thread's top frames; the odd ones are the ranks outside
    the largest group when that group holds most ranks (a lone rank among many, or among 2)."""
    by_place: dict[tuple[str, ...], list[int]] = {}
    for rank, text in sorted(stacks.items()):
        thread = training_thread(text)
        key = tuple(str(f) for f in thread.frames[:top]) if thread is not None else ()
        by_place.setdefault(key, []).append(rank)
    groups = sorted(by_place.items(), key=lambda item: (-len(item[1]), item[1]))
    odd: list[int] = []
    if len(groups) > 1 and len(groups[0][1]) > len(groups[1][1]):
        odd = sorted(r for _, ranks in groups[1:] for r in ranks)
    elif len(groups) == 2 and len(stacks) == 2:
        odd = _the_one_not_in_a_collective(groups)
    return Diagnosis(groups, odd)


def _the_one_not_in_a_collective(groups: list[tuple[tuple[str, ...], list[int]]]) -> list[int]:
    """Two ranks in two places: the one whose stack is not waiting in torch.distributed."""
    waiting = [any("distributed" in f or "all_reduce" in f or "wait" in f for f in frames)
               for frames, _ in groups]
    if waiting.count(True) == 1:
        return groups[waiting.index(False)][1]
    return []


def read_stacks(location: str, storage_options: dict[str, Any] | None = None) -> dict[int, str]:
    """rank -> stack text of a diagnostics directory (`rank-N.txt`), local or fsspec URI."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(location, **(storage_options or {}))
    out: dict[int, str] = {}
    for path in fs.ls(root, detail=False):
        match = re.search(r"rank-(\d+)\.txt$", path)
        if match:
            out[int(match.group(1))] = fs.cat(path).decode(errors="replace")
    if not out:
        raise FileNotFoundError(f"{location}: no rank-N.txt stack files here")
    return out


# ---- straggler evidence: several samples per rank, the flagged rank beside a healthy one ----
SAMPLE_MARK = "--- sample "  # "--- sample 3 at +0.412 s ---" opens each sample of a rank file
EVIDENCE_FILE = "evidence.json"  # what a location holds evidence of: cause, role of each rank


def join_samples(samples: list[tuple[float, str]]) -> str:
    """One rank file from (seconds since sampling began, stack text) samples."""
    return "".join(f"{SAMPLE_MARK}{i} at +{t:.3f} s ---\n{text}"
                   for i, (t, text) in enumerate(samples))


def split_samples(text: str) -> list[str]:
    """The samples of a rank file (a file without marks is one sample: a hang's dump)."""
    if SAMPLE_MARK not in text:
        return [text]
    parts = re.split(rf"^{re.escape(SAMPLE_MARK)}.*$\n?", text, flags=re.MULTILINE)
    return parts[1:]


def place_shares(text: str, top: int = 2) -> list[tuple[str, float]]:
    """Where a rank's training thread was across its samples: (top frames, share of the
    samples), most frequent first; a sample without a stack counts as "(no stack)"."""
    counts: dict[str, int] = {}
    samples = split_samples(text)
    for sample in samples:
        thread = training_thread(sample)
        frames = thread.frames[:top] if thread is not None else []
        key = " <- ".join(str(f) for f in frames) or "(no stack)"
        counts[key] = counts.get(key, 0) + 1
    return sorted(((k, n / len(samples)) for k, n in counts.items()), key=lambda kv: -kv[1])


def top_frame_shares(text: str) -> dict[str, float]:
    """Share of a rank's samples per top frame of its training thread."""
    out: dict[str, float] = {}
    for place, share in place_shares(text, top=1):
        out[place] = out.get(place, 0.0) + share
    return out


def compare_roles(stacks: dict[int, str], roles: dict[int, str], top: int = 2) -> str:
    """What each rank's training thread spent its samples on, and one sentence naming the
    place where the flagged ranks spent the largest share more than the healthy one."""
    lines = []
    for rank in sorted(stacks):
        role = roles.get(rank, "sampled")
        lines.append(f"rank {rank} ({role}), {len(split_samples(stacks[rank]))} sample(s):")
        lines += [f"    {share:4.0%}  {place}" for place, share in place_shares(stacks[rank], top)]
    healthy = [r for r in sorted(stacks) if roles.get(r) == "healthy"]
    base = top_frame_shares(stacks[healthy[0]]) if healthy else {}
    for rank in sorted(r for r in stacks if roles.get(r) == "straggler"):
        shares = top_frame_shares(stacks[rank])
        place, extra = max(((p, s - base.get(p, 0.0)) for p, s in shares.items()),
                           key=lambda pe: pe[1])
        against = f", rank {healthy[0]} (healthy) {base.get(place, 0.0):.0%}" if healthy else ""
        lines.append(f"rank {rank} (straggler) spends {shares[place]:.0%} of its samples in "
                     f"{place}{against}")
    return "\n".join(lines)


def read_evidence(location: str, storage_options: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The location's `evidence.json` ({} where there is none: a hang's location)."""
    import json

    import fsspec

    fs, root = fsspec.core.url_to_fs(location, **(storage_options or {}))
    path = f"{root.rstrip('/')}/{EVIDENCE_FILE}"
    if not fs.exists(path):
        return {}
    return json.loads(fs.cat(path).decode())
