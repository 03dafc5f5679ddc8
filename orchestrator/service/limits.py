"""What one service lets its clients hold: queue caps, priorities, reply pages, kept history.

Why: without limits one client could queue jobs until every submission and every scheduler
pass slowed down for everyone (both walk the queue under one lock), declare `priority: 1000`
to jump every queue, and make `tenax status` fail for all users once the finished jobs no
longer fit one gRPC reply (4 MiB). So a server has caps it refuses submissions at
(RESOURCE_EXHAUSTED, naming the flag), a maximum priority per token (`--token-file` lines
`token name [max_priority]`), paged listings, and a retention rule for finished jobs.

Also here: `UriClaims`, the index of the checkpoint roots unfinished jobs hold, so the check
that two jobs never share one costs O(depth of the path) instead of normalising every job's
URI at every submission.
"""
from __future__ import annotations

import base64
import bisect
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from tenax.orchestrator.errors import StorageRootError, SubmitError
from tenax.orchestrator.service.storage_roots import canonical_uri

logger = logging.getLogger(__name__)

MAX_JOB_ID = 200  # GetJob/CancelJob refuse longer ids: no job may be given one
DEFAULT_MAX_QUEUED_PER_TOKEN = 100
DEFAULT_MAX_QUEUED = 1000
DEFAULT_KEEP_FINISHED = 1000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_REPLY_BYTES = 3 << 20  # below gRPC's default 4 MiB receive limit, with room to spare
MAX_VERSION_BYTES = MAX_REPLY_BYTES - (64 << 10)  # one checkpoint version, room for the rest


@dataclass
class ServiceLimits:
    """Caps of one server (`tenax serve` flags). `keep_finished` None keeps every record."""
    max_queued_per_token: int = DEFAULT_MAX_QUEUED_PER_TOKEN
    max_queued: int = DEFAULT_MAX_QUEUED
    keep_finished: int | None = DEFAULT_KEEP_FINISHED

    def __post_init__(self) -> None:
        for name in ("max_queued_per_token", "max_queued", "keep_finished"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: {value!r} must be a whole number >= 1")


@dataclass(frozen=True)
class Identity:
    """Who a token belongs to: the name its jobs are counted under, and its highest priority
    (None: any priority the spec allows)."""
    name: str
    max_priority: int | None = None


ANONYMOUS = Identity("anonymous")  # a server without --token-file: every caller is one


def check_job_id(job_id: str) -> None:
    """A new job's id must be one GetJob and CancelJob accept (they refuse longer ones)."""
    if len(job_id) > MAX_JOB_ID:
        raise SubmitError(f"name: the job id {job_id[:60]!r}... would be {len(job_id)} "
                          f"characters, more than {MAX_JOB_ID}", "invalid")


def check_priority(caller: Identity, priority: int) -> None:
    """Refuse (never clamp: a silently lowered priority surprises its submitter later)."""
    if caller.max_priority is not None and priority > caller.max_priority:
        logger.warning("refused a submission of %s: priority %d above its maximum %d",
                       caller.name, priority, caller.max_priority)
        raise SubmitError(f"priority: {priority} is above the maximum {caller.max_priority} "
                          f"of token {caller.name!r} (--token-file)", "denied")


def check_queue(limits: ServiceLimits, caller: Identity, owners: list[str]) -> None:
    """`owners`: the owner of every queued job. RESOURCE_EXHAUSTED naming the cap reached."""
    mine = sum(1 for owner in owners if owner == caller.name)
    if mine >= limits.max_queued_per_token:
        logger.warning("refused a submission of %s: %d of its jobs queued", caller.name, mine)
        raise SubmitError(f"{caller.name!r} already has {mine} queued job(s), the most one "
                          f"token may queue (--max-queued-per-token "
                          f"{limits.max_queued_per_token}); wait or cancel some", "exhausted")
    if len(owners) >= limits.max_queued:
        logger.warning("refused a submission of %s: %d jobs queued", caller.name, len(owners))
        raise SubmitError(f"{len(owners)} jobs are queued, the most this server queues "
                          f"(--max-queued {limits.max_queued}); try again later", "exhausted")


# ---- pages ---------------------------------------------------------------------------------
def page_size(requested: int, limit: int) -> int:
    """Jobs in one ListJobs reply: the asked page size (or `limit`, or the default), capped."""
    size = requested or limit or DEFAULT_PAGE_SIZE
    if limit:
        size = min(size, limit)
    return max(1, min(size, MAX_PAGE_SIZE))


def fill_page(items: list[Any], render: Callable[[Any], Any],
              size_of: Callable[[Any], int]) -> tuple[list[Any], bool]:
    """Render items until the reply would pass MAX_REPLY_BYTES (one item always fits: a spec
    is at most 1 MiB); returns the rendered ones and whether some were left for the next page."""
    out, used = [], 0
    for item in items:
        message = render(item)
        used += size_of(message) + 8  # the field's tag and length
        if out and used > MAX_REPLY_BYTES:
            return out, True
        out.append(message)
    return out, False


def encode_page_token(created_at: float, job_id: str) -> str:
    """Where the next page starts: after this job in (created_at DESC, job_id) order."""
    raw = json.dumps([created_at, job_id]).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii")


def decode_page_token(token: str) -> tuple[float, str] | None:
    """None for ''; ValueError naming the field for anything `encode_page_token` did not make."""
    if not token:
        return None
    try:
        created_at, job_id = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or \
                not isinstance(job_id, str):
            raise TypeError("not a position")
    except (ValueError, TypeError, UnicodeError, RecursionError) as err:
        raise ValueError(f"page_token: {token[:40]!r} is not a token this server gave "
                         f"({type(err).__name__})") from None
    return float(created_at), job_id


def encode_step_token(step: int) -> str:
    """Where ListCheckpoints' next page starts: after this step."""
    return base64.urlsafe_b64encode(json.dumps({"after_step": step}).encode()).decode("ascii")


def decode_step_token(token: str) -> int | None:
    """None for ''; ValueError naming the field for anything `encode_step_token` did not make."""
    if not token:
        return None
    try:
        step = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))["after_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError("not a step")
    except (ValueError, TypeError, KeyError, UnicodeError, RecursionError) as err:
        raise ValueError(f"page_token: {token[:40]!r} is not a token this server gave "
                         f"({type(err).__name__})") from None
    return step


# ---- checkpoint roots in use ---------------------------------------------------------------
def claim_keys(uri: str) -> tuple[str | None, str]:
    """(normal form or None when it has none, the raw spelling without trailing '/'): what
    `storage_roots.overlapping` compares (raw spellings when either side has no normal form)."""
    try:
        canon: str | None = str(canonical_uri(uri))
    except StorageRootError:
        canon = None
    return canon, uri.rstrip("/")


def _ancestors(key: str) -> list[str]:
    """`key` and every directory above it, in the same normal form."""
    scheme, sep, path = key.partition("://")
    if not sep:
        return [key]
    out = [key]
    while "/" in path.strip("/"):
        path = path.rstrip("/").rsplit("/", 1)[0] or "/"
        out.append(f"{scheme}://{path}")
    if path.startswith("/") and path != "/":
        out.append(f"{scheme}:///")
    return out


class UriClaims:
    """The checkpoint roots held by jobs, normalised once when claimed; `holders` finds one,
    its parents and its children without walking every job. Entries of finished jobs are
    dropped when met."""

    def __init__(self) -> None:
        self._by_job: dict[str, tuple[str | None, str]] = {}
        self._canon: dict[str, set[str]] = {}  # normal form -> job ids
        self._sorted: list[str] = []  # the normal forms, sorted: children are one range
        self._raw: dict[str, set[str]] = {}  # raw spelling -> job ids (every claim)
        self._odd: set[str] = set()  # jobs whose URI has no normal form

    def claim(self, job_id: str, uri: str) -> None:
        self.release(job_id)
        canon, raw = self._by_job[job_id] = claim_keys(uri)
        self._raw.setdefault(raw, set()).add(job_id)
        if canon is None:
            self._odd.add(job_id)
            return
        if canon not in self._canon:
            self._canon[canon] = set()
            bisect.insort(self._sorted, canon)
        self._canon[canon].add(job_id)

    def release(self, job_id: str) -> None:
        keys = self._by_job.pop(job_id, None)
        if keys is None:
            return
        canon, raw = keys
        _discard(self._raw, raw, job_id)
        self._odd.discard(job_id)
        if canon is not None and _discard(self._canon, canon, job_id):
            self._sorted.pop(bisect.bisect_left(self._sorted, canon))

    def holders(self, uri: str, alive: Callable[[str], bool]) -> list[str]:
        """Live jobs whose root is `uri` (any spelling), holds it, or lies inside it."""
        canon, raw = claim_keys(uri)
        same = self._raw.get(raw, set())
        found = set(same) if canon is None else {j for j in same if j in self._odd}
        if canon is not None:
            found.update(j for k in _ancestors(canon) for j in self._canon.get(k, ()))
            prefix = canon.rstrip("/") + "/"
            at = bisect.bisect_left(self._sorted, prefix)
            while at < len(self._sorted) and self._sorted[at].startswith(prefix):
                found.update(self._canon[self._sorted[at]])
                at += 1
        live = []
        for job in sorted(found):
            if alive(job):
                live.append(job)
            else:
                self.release(job)
        return live


def _discard(index: dict[str, set[str]], key: str, job_id: str) -> bool:
    """Remove `job_id` under `key`; True when the key has no job left (and is gone)."""
    jobs = index.get(key)
    if jobs is None:
        return False
    jobs.discard(job_id)
    if jobs:
        return False
    del index[key]
    return True


class WatcherSlots:
    """WatchJob streams: each holds a server worker thread, so at most `total` at once, and at
    most `per_caller` for one identity, so that one token's streams (a script that forgets to
    close them) cannot refuse every other user's `tenax watch`."""

    def __init__(self, total: int, per_caller: int) -> None:
        self.total, self.per_caller = total, per_caller
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def acquire(self, who: str) -> str | None:
        """Take a slot for `who`; None when taken, else why not (RESOURCE_EXHAUSTED)."""
        with self._lock:
            if self._held[who] >= self.per_caller:
                return (f"too many watchers for {who} (at most {self.per_caller} per token); "
                        f"close one, or try again later")
            if sum(self._held.values()) >= self.total:
                return f"too many watchers (at most {self.total}); try again later"
            self._held[who] += 1
            return None

    def release(self, who: str) -> None:
        with self._lock:
            self._held[who] -= 1
            if self._held[who] <= 0:
                del self._held[who]
