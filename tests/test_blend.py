"""Weighted blends (workers/data/blend.py) and indexed datasets as sources (sources.py): shares,
purity of the assignment, exact windows, and clear errors before anything trains."""
from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from tenax.workers.data import (BlendAssignment, IndexedDatasetWriter, TokenDataLoader,
                                source_order)
from tenax.workers.errors import SpecError
from tenax.workers.spec import DataSpec, spec_from_dict

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

SEQ, VOCAB, SEED = 16, 512, 11
WINDOW = 10_000


def write_indexed(prefix: Path, docs: list[np.ndarray]) -> str:
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


def make_docs(rng: np.random.Generator, n_docs: int, low: int, high: int) -> list[np.ndarray]:
    """Documents of random length whose tokens lie in [low, high): the source shows in a row."""
    return [rng.integers(low, high, size=int(rng.integers(5, 60))) for _ in range(n_docs)]


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 2, 7], [0.05, 0.95], [3, 3, 3, 1]])
@pytest.mark.parametrize("start", [0, 12_345, 10**9 + 7])
def test_shares_within_one_percent_over_any_window(weights: list[float], start: int) -> None:
    blend = BlendAssignment(weights, SEED)
    source, _ = blend.locate(np.arange(start, start + WINDOW))
    total = sum(weights)
    for j, w in enumerate(weights):
        share = float((source == j).mean())
        assert abs(share - w / total) <= 0.01, (j, share, w / total)


def test_per_source_indices_are_dense_and_disjoint() -> None:
    """Each source's own indices over the first N samples are exactly 0..count-1, once each:
    no window of a source is skipped or read twice within an epoch."""
    weights = [0.5, 0.3, 0.2]
    blend = BlendAssignment(weights, SEED)
    n = blend.block * 50
    source, within = blend.locate(np.arange(n))
    for j in range(len(weights)):
        got = np.sort(within[source == j])
        assert np.array_equal(got, np.arange(got.size))
        assert abs(got.size - n * weights[j]) <= 1  # whole blocks are exact to one sample


def test_assignment_is_pure() -> None:
    """Same k -> same (source, index) whatever the chunking, order or object."""
    weights = [1.0, 2.5, 0.5]
    ref_src, ref_in = BlendAssignment(weights, SEED).locate(np.arange(5_000))
    other = BlendAssignment(weights, SEED)
    rng = np.random.default_rng(0)
    order = rng.permutation(5_000)
    src, within = other.locate(order)
    assert np.array_equal(src, ref_src[order]) and np.array_equal(within, ref_in[order])
    for lo, hi in [(0, 7), (63, 65), (4_000, 5_000)]:
        s, w = other.locate(np.arange(lo, hi))
        assert np.array_equal(s, ref_src[lo:hi]) and np.array_equal(w, ref_in[lo:hi])
    different, _ = BlendAssignment(weights, SEED + 1).locate(np.arange(5_000))
    assert not np.array_equal(different, ref_src)


def test_cumulative_is_the_rounded_share() -> None:
    """Independent reference: exact rational shares, largest remainder."""
    weights = [0.1, 0.2, 0.7]
    blend = BlendAssignment(weights, SEED)
    for b in (0, 1, 2, 3, 17, 1000):
        counts = blend.cumulative(b)
        assert counts.sum() == blend.block * b
        for j, w in enumerate(weights):
            exact = Fraction(w) / sum(Fraction(x) for x in weights) * blend.block * b
            assert abs(counts[j] - exact) < 1


def test_tiny_weight_gets_its_share() -> None:
    blend = BlendAssignment([0.001, 0.999], SEED)
    assert blend.block >= 1000
    source, _ = blend.locate(np.arange(blend.block * 20))
    assert int((source == 0).sum()) == 20


def test_blend_of_two_indexed_datasets_reads_exact_windows(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    docs_a, docs_b = make_docs(rng, 40, 0, 100), make_docs(rng, 60, 300, 400)
    a = write_indexed(tmp_path / "a", docs_a)
    b = write_indexed(tmp_path / "b", docs_b)
    streams = [np.concatenate(docs_a), np.concatenate(docs_b)]
    spec = DataSpec(sources=[{"uri": a, "weight": 1.0}, {"uri": b, "weight": 3.0}])
    loader = TokenDataLoader(spec, SEQ, VOCAB, SEED, 8)
    n = [(s.size - 1) // SEQ for s in streams]
    source, within = BlendAssignment([1.0, 3.0], SEED).locate(np.arange(40))
    for step in range(5):
        x, y = loader.batch(step, 0, 1)
        for row in range(8):
            k = step * 8 + row
            j = int(source[k])
            sample = int(source_order(np.array([within[k]]), n[j], f"{SEED}-blend-{j}")[0])
            window = streams[j][sample * SEQ: sample * SEQ + SEQ + 1]
            assert x[row].tolist() == window[:-1].tolist()
            assert y[row].tolist() == window[1:].tolist()


def test_blend_batches_are_the_same_under_any_dp_and_resume(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    a = write_indexed(tmp_path / "a", make_docs(rng, 10, 0, 100))  # small: cycles epochs
    b = write_indexed(tmp_path / "b", make_docs(rng, 30, 300, 400))
    spec = DataSpec(sources=[{"uri": a, "weight": 0.4}, {"uri": b, "weight": 0.6}])
    loader = TokenDataLoader(spec, SEQ, VOCAB, SEED, 8)
    whole = [loader.batch(step, 0, 1)[0] for step in range(30)]
    for dp in (2, 4):
        for step in (0, 7, 29):
            parts = [loader.batch(step, r, dp)[0] for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole[step])
    resumed = TokenDataLoader(spec, SEQ, VOCAB, SEED, 8)
    resumed.load_state_dict({"samples_consumed": 8 * 20})
    assert torch.equal(resumed.next_batch(0, 1)[0], whole[20])


def test_indexed_single_source_is_the_flat_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    docs = make_docs(rng, 30, 0, VOCAB)
    prefix = write_indexed(tmp_path / "one", docs)
    stream = np.concatenate(docs)
    loader = TokenDataLoader(DataSpec(source=prefix), SEQ, VOCAB, SEED, 4)
    assert loader.num_samples == (stream.size - 1) // SEQ
    ids = loader.sample_ids(4, 4)
    x, y = loader.batch(1, 0, 1)
    for row, sample in enumerate(ids.tolist()):
        window = stream[sample * SEQ: sample * SEQ + SEQ + 1]
        assert x[row].tolist() == window[:-1].tolist() and y[row].tolist() == window[1:].tolist()


def test_token_id_outside_vocab_is_refused_without_echoing_it(tmp_path: Path) -> None:
    docs = [np.arange(40) % 100, np.array([5, 6, 7, 40_000, 8] * 10)]
    prefix = write_indexed(tmp_path / "big", docs)
    loader = TokenDataLoader(DataSpec(source=prefix), SEQ, VOCAB, SEED, 8)
    with pytest.raises(ValueError, match=r"a token id outside \[0, model.vocab_size=512\) in "
                                         r"sample \d+ of") as err:
        loader.batch(0, 0, 1)
    assert "40000" not in str(err.value) and loader.samples_consumed == 0


@pytest.mark.parametrize("data, match", [
    ({"source": "file:///x.bin", "sources": [{"uri": "a", "weight": 1}]},
     "give data.source .* or data.sources .*not both"),
    ({"sources": [{"uri": "a", "weight": 1}, {"uri": "b", "weight": 0}]},
     r"data.sources.1.weight: .*greater than 0 \(got 0\)"),
    ({"sources": [{"uri": "a", "weight": 1}, {"uri": "b", "weight": -2.5}]},
     r"data.sources.1.weight: .*greater than 0 \(got -2.5\)"),
    ({"sources": []}, "data.sources: .*at least 1"),
    ({"sources": [{"uri": "a", "weight": 1e20}, {"uri": "b", "weight": 1}]},
     r"data.sources\[1\].weight: share 1e-20 is below 1e-6"),
    ({"eos_id": 600}, r"data.eos_id: 600 is outside \[0, model.vocab_size=512\)"),
])
def test_bad_blend_specs_are_refused(data: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        spec_from_dict({"data": data})


def test_bad_weight_refused_by_the_engine_too() -> None:
    with pytest.raises(ValueError, match=r"data.sources\[1\].weight: must be a number > 0, "
                                         r"got 0"):
        BlendAssignment([1.0, 0], SEED)


def test_a_share_below_one_in_a_million_is_refused() -> None:
    """Blocks hold 1 / (smallest share) samples: an extreme ratio must be refused by name, not
    overflow; a share of exactly 1e-6 still blends, to the sample."""
    with pytest.raises(ValueError, match=r"data.sources\[1\].weight: share 1e-20 is below 1e-6"):
        BlendAssignment([1e20, 1], SEED)
    with pytest.raises(ValueError, match=r"data.sources\[0\].weight: share 9.99999e-7 is below"):
        BlendAssignment([1, 1e6], SEED)
    blend = BlendAssignment([1, 10**6 - 1], SEED)
    assert blend.block == 10**6
    assert blend.cumulative(3).tolist() == [3, 3 * (10**6 - 1)]
    source, within = blend.locate(np.arange(10**6, 2 * 10**6))  # block 1, whole
    assert int((source == 0).sum()) == 1 and within[source == 0].tolist() == [1]


ONE_NODE = ["train.steps=20", "resources.nodes=1", "resources.gpus_per_node=2",
            "resources.max_nodes=2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_blend_job_killed_and_resumed_in_another_layout_matches_the_clean_run(
        tmp_path: Path) -> None:
    """A job on a blend of two indexed datasets loses a rank at step 12 while a scale to two
    nodes arrives, and resumes on 4 ranks instead of 2: every step's loss equals the
    single-process run's, and the validation events go on after the recovery."""
    import ray

    from tenax.testing.clusters import start_local_ray
    from tenax.testing.jobs import assert_same_losses, make_spec, reference_losses, run_job

    rng = np.random.default_rng(6)  # SMALL's vocabulary is 64
    a = write_indexed(tmp_path / "a", make_docs(rng, 80, 0, 30))
    b = write_indexed(tmp_path / "b", make_docs(rng, 80, 30, 64))
    blend = f"data.sources=[{{uri: '{a}', weight: 0.7}}, {{uri: '{b}', weight: 0.3}}]"
    val = f"data.validation={{uri: '{b}', every_steps: 5, steps: 2}}"
    start_local_ray(gpus=4)
    try:
        spec = make_spec(tmp_path, ONE_NODE + [blend, val], "blendkill")
        job = run_job(spec, chaos="scale nodes=2 at=12; kill rank=1 at=12", timeout_s=600)
        assert job.controller.state.value == "SUCCEEDED", job.controller.cause
        assert job.of("failure") and job.controller.restarts >= 1
        placed = job.of("placed")
        assert placed[0]["world_size"] == 2 and placed[-1]["world_size"] == 4, placed
        assert_same_losses(job.losses(), reference_losses(spec))
        evals = {e["step"]: e["loss"] for e in job.of("eval")}
        assert {5, 10, 15, 20} <= set(evals) and all(np.isfinite(v) for v in evals.values())
    finally:
        ray.shutdown()


def test_every_data_uri_is_held_to_the_storage_roots(tmp_path: Path) -> None:
    """Behind `tenax serve`, a blend's sources, the tokenizer and the validation set are
    checked like data.source: a second source outside the roots is refused, naming it."""
    from tenax.orchestrator.errors import StorageRootError
    from tenax.orchestrator.service.storage_roots import StorageRoots

    roots = StorageRoots([f"file://{tmp_path}/ok"])
    inside, outside = f"file://{tmp_path}/ok/a", f"file://{tmp_path}/secret"
    good = [{"uri": inside, "weight": 1}]
    for data, field in (({"sources": good + [{"uri": outside, "weight": 1}]},
                         r"data.sources\[1\].uri"),
                        ({"sources": good, "validation": {"uri": outside}}, "data.validation.uri"),
                        ({"source": outside}, "data.source")):
        with pytest.raises(StorageRootError, match=field):
            roots.check_spec(spec_from_dict({"data": data,
                                             "checkpoint": {"uri": f"{inside}/ck"}}))
    roots.check_spec(spec_from_dict({"data": {"sources": good, "validation": {"uri": inside}},
                                     "checkpoint": {"uri": f"{inside}/ck"}}))
