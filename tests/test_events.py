"""The one event model: every kind reads as a sentence, `--log-json` keeps DESIGN.md's pinned
fields (plus `time`), relaying never restamps an event, and every front-end prints the same
sentence (`tenax run`'s console, `tenax watch`, the launcher)."""
from __future__ import annotations

import io
import json
import re

import pytest

from tenax.orchestrator.cli.client import human_line
from tenax.orchestrator.cli.runner import EventSink
from tenax.workers.events import KINDS, Event, human, layout_text

LAYOUT = {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 1}
# One example per kind, with DESIGN.md's pinned fields where it pins them.
EXAMPLES = {
    "step": {"step": 12, "loss": 5.91, "tokens_per_s": 8123.0, "world_size": 4, "layout": LAYOUT},
    "failure": {"step": 30, "rank": 1, "cause": "rank 1 died (SIGKILL)", "kind": "dead"},
    "recovered": {"step": 20, "layout": LAYOUT, "seconds": 4.2, "lost_steps": 1, "world_size": 4,
                  "source": "memory"},
    "snapshot": {"step": 20, "bytes": 1024, "seconds": 0.01, "generation": 1},
    "snapshots_off": {"reason": "checkpoint.memory_every_steps=1: 3 GiB per node exceeds "
                                "0.5 x 4 GiB"},
    "tracking_off": {"backend": "tensorboard", "reason": "open failed: OSError: read-only",
                     "step": 0},
    "checkpoint": {"step": 20, "blocked_s": 0.01, "total_s": 0.4},
    "eval": {"step": 100, "loss": 3.25, "tokens": 40960, "seconds": 0.8},
    "checkpoint_failed": {"step": 20, "cause": "OSError: disk full"},
    "checkpoint_loaded": {"step": 20, "seconds": 1.5},
    "scaled": {"step": 8, "from": LAYOUT, "from_world": 2, "layout": LAYOUT, "world_size": 4,
               "seconds": 3.0, "lost_steps": 0},
    "straggler": {"rank": 2, "score": 0.7, "action": "alert"},
    "profile": {"step": 12, "steps": [10, 12], "diagnostics": "file:///c/diagnostics/x-profile"},
    "done": {"step": 200, "loss": 5.1, "restarts": 1, "lost_steps": 2,
             "goodput": {"goodput": 0.93}},
    "state": {"state": "RUNNING", "reason": "started dp2 (2 ranks on 1 node(s))"},
    "placed": {"layout": LAYOUT, "world_size": 4, "nodes": ["a", "a", "b", "b"], "mode": "warm",
               "reused": 2, "created": 2},
    "chaos": {"kind": "corrupt-checkpoint", "detail": "flipped 16 bytes of step-00000010/x"},
    "started": {"step": 10, "rank": 0},
    "resumed": {"was": "RUNNING", "reason": "service restarted"},
    "rank_done": {"rank": 0},
    "cancel_requested": {"reason": "CancelJob from 127.0.0.1"},
    "queued": {"reason": "priority 0 behind 2 jobs"},
    "admitted": {"reason": "4 GPUs free"},
    "shrunk": {"reason": "a priority 5 job needs 2 nodes"},
    "grown": {"reason": "2 nodes free again"},
    "preempted": {"reason": "stopped at a checkpoint for a priority 9 job"},
    "preflight": {"verdict": "warn", "rows": [
        {"name": "data", "measured": "4 batches", "expected": "ids in [0, 64)",
         "verdict": "pass", "detail": "40 samples"},
        {"name": "links", "measured": "dp 0.4x", "expected": "median group",
         "verdict": "warn", "detail": "slow links on node 1"}]},
}
SENTENCE = re.compile(r"^[A-Z][^{}\n]*\.$")


def test_every_kind_has_an_example_and_reads_as_a_sentence() -> None:
    assert set(EXAMPLES) == set(KINDS)
    for kind, fields in EXAMPLES.items():
        text = Event(kind, fields, 1.7e9).human()
        assert SENTENCE.match(text), f"{kind}: {text!r}"
        assert "{" not in text and "None" not in text, f"{kind}: {text!r}"


@pytest.mark.parametrize("kind", ["step", "failure", "recovered", "done", "state"])
def test_a_record_missing_fields_still_reads_as_a_sentence(kind: str) -> None:
    assert SENTENCE.match(human({"event": kind})), human({"event": kind})
    assert SENTENCE.match(human({"event": "brand-new", "x": 1}))


def test_placed_says_how_many_of_the_plans_nodes_share_a_ray_node() -> None:
    """An embedded Ray is one node holding every block: the sentence must not contradict the
    RUNNING state's "4 ranks on 2 node(s)"."""
    one_ray_node = {"layout": LAYOUT, "world_size": 4, "nodes": ["a"] * 4, "blocks": 2}
    assert human({"event": "placed", **one_ray_node}) == (
        f"Placed 4 ranks ({layout_text(LAYOUT)}) on 1 node as 2 blocks of 2 ranks.")
    two = {**one_ray_node, "nodes": ["a", "a", "b", "b"]}
    assert human({"event": "placed", **two}) == \
        f"Placed 4 ranks ({layout_text(LAYOUT)}) on 2 nodes."


def test_done_and_already_complete_say_what_happened() -> None:
    done = human({"event": "done", **EXAMPLES["done"]})
    assert done == ("The job finished at step 200 with loss 5.1000 (1 restart, 2 lost steps, "
                    "goodput 93%).")
    again = human({"event": "done", "step": 60, "loss": None, "already_complete": True})
    assert "already complete at step 60" in again


def test_json_form_keeps_pinned_fields_and_adds_the_time_it_happened() -> None:
    for kind, fields in EXAMPLES.items():
        doc = Event.make(kind, **fields, time=1234.5).to_dict()
        assert doc == {"event": kind, **fields, "time": 1234.5}
        assert list(doc)[0] == "event"
        assert Event.from_dict(doc).to_dict() == doc  # relaying never restamps


def test_make_stamps_now_when_no_time_is_given() -> None:
    import time

    before = time.time()
    event = Event.make("state", state="RUNNING", reason="x")
    assert before <= event.time <= time.time()


def test_run_sink_writes_the_event_unchanged_and_prints_its_sentence(tmp_path) -> None:
    from rich.console import Console

    out = io.StringIO()
    log = tmp_path / "log.jsonl"
    sink = EventSink(str(log), Console(file=out, width=400), None, None, 60)
    docs = [{**Event.make(kind, **EXAMPLES[kind], time=99.0).to_dict(), "job": "j-1"}
            for kind in ("step", "failure", "recovered", "done", "checkpoint")]
    for doc in docs:
        sink(doc)
    sink.close()
    written = [json.loads(line) for line in log.read_text().splitlines()]
    assert written == [{k: v for k, v in d.items() if k != "job"} for d in docs]
    printed = out.getvalue()
    for doc in docs[1:]:
        assert human(doc) in printed
    assert "{" not in printed  # no raw JSON on the console, `done` included


def test_watch_prints_the_same_sentence_with_the_event_time() -> None:
    doc = {"event": "failure", **EXAMPLES["failure"], "time": 0.0, "seq": 3}
    line = human_line(doc)
    assert line.endswith(human(doc)) and re.match(r"^\d\d:\d\d:\d\d ", line)


def test_layout_text_is_one_format() -> None:
    assert layout_text(LAYOUT) == "dp2 tp2 zero1"
    assert layout_text(None) == "-"


def test_a_relayed_snapshot_names_rank_0() -> None:
    """The controller relays rank 0's first snapshot of an attempt without its `rank` field."""
    line = human({"event": "snapshot", "step": 1, "bytes": 10, "seconds": 0.01})
    assert line.startswith("Rank 0 kept step 1 in memory")
