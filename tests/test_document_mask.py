"""Document-aware training (workers/data/documents.py): block-causal attention and restarting
rotary positions equal running each document alone; the same holds under dp and tp; EOS targets
drop out of the loss; layouts that cannot carry a mask are refused."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tenax.parallel import build_model
from tenax.workers.data import (IGNORE_INDEX, IndexedDatasetWriter, document_ids, document_mask,
                                document_positions, mask_eos_targets)
from tenax.workers.errors import SpecError
from tests.distributed import run_ranks
from tests.engine_jobs import tiny_spec, train_job

logger = logging.getLogger(__name__)
torch.set_num_threads(1)

EOS = 127  # inside TINY's vocab of 128
STEPS = 3


def reference_positions(row: list[int], eos: int) -> tuple[list[int], list[int]]:
    """Plain-Python document ids and positions of one row."""
    ids, pos, doc, start = [], [], 0, 0
    for t, token in enumerate(row):
        ids.append(doc)
        pos.append(t - start)
        if token == eos:
            doc, start = doc + 1, t + 1
    return ids, pos


def test_positions_and_ids_match_a_plain_loop() -> None:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, 6, size=(5, 40)))  # EOS = 5 appears often
    x[0, 0] = 5  # a window that starts with an EOS
    x[1, -1] = 5
    ids, pos = document_ids(x, 5), document_positions(x, 5)
    for b in range(x.shape[0]):
        want_ids, want_pos = reference_positions(x[b].tolist(), 5)
        assert ids[b].tolist() == want_ids and pos[b].tolist() == want_pos
    mask = document_mask(x, 5)
    assert mask.shape == (5, 1, 40, 40) and mask.dtype == torch.bool
    for b in range(x.shape[0]):
        for i in range(40):
            for j in range(40):
                assert bool(mask[b, 0, i, j]) == (j <= i and ids[b, i] == ids[b, j])


def test_mask_eos_targets() -> None:
    x = torch.tensor([[1, 5, 2, 3, 5, 4]])
    y = torch.tensor([[5, 2, 3, 5, 4, 1]])
    assert mask_eos_targets(x, y, 5).tolist() == [[5, IGNORE_INDEX, 3, 5, IGNORE_INDEX, 1]]


def test_block_causal_equals_each_document_alone() -> None:
    spec = tiny_spec()
    model = build_model(spec.model.args(), seed=3).eval()
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, EOS, size=n).tolist() + [EOS] for n in (6, 11, 3)]
    row = sum(docs, [])[:32]
    row += rng.integers(0, EOS, size=32 - len(row)).tolist()  # a last, unfinished document
    x = torch.tensor([row, row[::-1]])  # the reversed row has other boundaries
    with torch.no_grad():
        logits = model(x, positions=document_positions(x, EOS),
                       attn_mask=document_mask(x, EOS))
        plain = model(x)
        for b in range(2):
            ids = document_ids(x[b:b + 1], EOS)[0]
            for doc in ids.unique().tolist():
                cols = (ids == doc).nonzero().flatten()
                alone = model(x[b:b + 1, cols])  # positions arange, plain causal
                torch.testing.assert_close(logits[b, cols], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)  # the mask does change something


def write_docs(path: Path, seed: int = 0) -> str:
    """Short documents ending in EOS, so each 33-token window spans several."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(path), np.uint16) as writer:
        for _ in range(300):
            writer.add_document(rng.integers(0, EOS, size=int(rng.integers(3, 20))).tolist()
                                + [EOS])
    return str(path)


def first_step_job(rank: int, world: int, extra: list[str]) -> dict[str, Any]:
    """The trainer's first loss, and a plain-torch loss of the same batch and weights."""
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.data import TokenDataLoader
    from tenax.workers.trainer import Trainer

    spec = tiny_spec(extra)
    model = build_model(spec.model.args(), spec.train.seed)
    x, y = TokenDataLoader.from_job_spec(spec).batch(0, 0, 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(x.shape[0]):
            ids = document_ids(x[b:b + 1], EOS)[0]
            for doc in ids.unique().tolist():
                cols = (ids == doc).nonzero().flatten()
                targets = y[b, cols].clone()
                targets[x[b, cols] == EOS] = IGNORE_INDEX
                logits = model(x[b:b + 1, cols])[0]
                total += F.cross_entropy(logits, targets, reduction="sum").item()
                count += int((targets != IGNORE_INDEX).sum())
    trainer = Trainer(spec, ParallelLayout(micro_batch_size=1))
    return {"loss": trainer.run_step().loss, "reference": total / count}


def test_training_loss_is_the_per_document_reference(tmp_path: Path) -> None:
    data = write_docs(tmp_path / "docs")
    extra = [f"data.source={data}", "data.document_mask=true", "data.mask_eos_loss=true",
             f"data.eos_id={EOS}"]
    out = run_ranks(first_step_job, 1, extra)[0]
    assert out["loss"] == pytest.approx(out["reference"], rel=1e-5)


def write_bpe_like(path: Path, eos: int, n_docs: int = 80) -> str:
    """Documents ending in `eos`; ids 1..299 in between, so 256 is an ordinary token here."""
    rng = np.random.default_rng(5)
    with IndexedDatasetWriter(str(path), np.uint16) as writer:
        for _ in range(n_docs):
            body = rng.integers(1, 300, size=int(rng.integers(3, 20)))
            writer.add_document(np.append(body[body != eos], eos))
    return str(path)


@pytest.mark.parametrize("feature", ["document_mask", "mask_eos_loss"])
def test_documents_that_do_not_end_with_the_eos_are_refused(tmp_path: Path,
                                                            feature: str) -> None:
    """A BPE dataset (EOS 0) read with the byte-level default EOS (256) would make both
    features silent no-ops: the loader checks the documents' last tokens when it opens them."""
    from tenax.workers.data import TokenDataLoader
    from tenax.workers.spec import DataSpec

    bpe = write_bpe_like(tmp_path / "bpe", eos=0)
    spec = DataSpec(source=bpe, **{feature: True})
    with pytest.raises(ValueError) as err:
        TokenDataLoader(spec, 32, 512, 0, 4)
    assert str(err.value) == (f"data.{feature}: documents of {bpe!r} do not end with eos id "
                              f"256; set data.tokenizer or data.eos_id (Megatron: --append-eod)")
    TokenDataLoader(DataSpec(source=bpe, eos_id=0, **{feature: True}), 32, 512, 0, 4)
    TokenDataLoader(DataSpec(source=bpe), 32, 512, 0, 4)  # neither feature: no check
    byte_level = write_bpe_like(tmp_path / "bytes", eos=256)
    TokenDataLoader(DataSpec(source=byte_level, **{feature: True}), 32, 512, 0, 4)
    blend = [{"uri": byte_level, "weight": 1}, {"uri": bpe, "weight": 1}]
    with pytest.raises(ValueError, match=f"documents of {bpe!r} do not end with eos id 256"):
        TokenDataLoader(DataSpec(sources=blend, **{feature: True}), 32, 512, 0, 4)


def test_the_eos_check_reads_only_the_first_documents(tmp_path: Path) -> None:
    """The first 64 documents decide (a cheap check on open); one bad among them is enough."""
    from tenax.workers.data import TokenDataLoader
    from tenax.workers.spec import DataSpec

    for bad, refused in ((63, True), (64, False)):
        rng = np.random.default_rng(bad)
        prefix = str(tmp_path / f"bad{bad}")
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            writer.add_document([])  # document 0 is empty: it has no last token to check
            for d in range(1, 100):
                writer.add_document(rng.integers(1, EOS, size=5).tolist()
                                    + ([] if d == bad else [EOS]))
        spec = DataSpec(source=prefix, document_mask=True, eos_id=EOS)
        if refused:
            with pytest.raises(ValueError, match="do not end with eos id 127"):
                TokenDataLoader(spec, 16, 128, 0, 4)
        else:
            TokenDataLoader(spec, 16, 128, 0, 4)


LAYOUTS = [dict(dp=2, zero=1), dict(tp=2), pytest.param(dict(dp=2, tp=2), marks=pytest.mark.slow)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_document_mask_parity_with_single_process(tmp_path: Path, layout: dict) -> None:
    data = write_docs(tmp_path / "docs")
    extra = [f"data.source={data}", "data.document_mask=true", "data.mask_eos_loss=true",
             f"data.eos_id={EOS}", "train.lr=0.5"]
    ref = run_ranks(train_job, 1, {"micro_batch_size": 1}, "sgd", STEPS, extra)[0]
    world = layout.get("dp", 1) * layout.get("tp", 1)
    out = run_ranks(train_job, world, {**layout, "micro_batch_size": 1}, "sgd", STEPS, extra)[0]
    for name in ("loss", "grad_norm"):
        got, want = torch.tensor(out[name]), torch.tensor(ref[name])
        assert ((got - want).abs() / want.abs()).max().item() < 1e-5, (name, got, want)
    for key, want in ref["params"].items():
        assert (out["params"][key] - want).abs().max().item() < 1e-5, key
    plain = run_ranks(train_job, 1, {"micro_batch_size": 1}, "sgd", STEPS,
                      [f"data.source={data}", "train.lr=0.5"])[0]
    moved = max((plain["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    assert moved > 1e-4  # documents change the training, so the parity above means something


@pytest.mark.parametrize("degree", ["cp", "pp"])
def test_layouts_without_masks_are_refused(degree: str) -> None:
    with pytest.raises(SpecError, match=f"data.document_mask: not supported with "
                                        f"parallel.{degree}=2"):
        tiny_spec(["data.document_mask=true", f"parallel.{degree}=2", "model.n_layers=2"])


def refused_layout_job(rank: int, world: int) -> str:
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    try:
        Trainer(tiny_spec(["data.document_mask=true"]), ParallelLayout(cp=2, micro_batch_size=1))
    except ValueError as err:
        return str(err)
    return "no error"


def test_trainer_refuses_a_planned_cp_layout() -> None:
    """The spec refuses document masks unless parallel.cp and parallel.pp are 1 (`auto`
    included), so no planned layout reaches the trainer with cp > 1; the trainer still checks
    the layout it is handed, which a caller may build apart from the spec."""
    out = run_ranks(refused_layout_job, 2)
    assert all("data.document_mask: not supported with parallel.cp=2" in m for m in out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2, pp_schedule="1f1b"), dict(cp=2)],
                         ids=["pp2", "cp2"])
def test_mask_eos_loss_parity_under_pp_and_cp(tmp_path: Path, layout: dict) -> None:
    """Without document masks, ignoring EOS targets works under every layout: the count of
    counted tokens is reduced over dp x cp, and pipeline stages scale by it."""
    data = write_docs(tmp_path / "docs")
    extra = [f"data.source={data}", "data.mask_eos_loss=true", f"data.eos_id={EOS}",
             "train.lr=0.5", "model.n_layers=4"]
    ref = run_ranks(train_job, 1, {"micro_batch_size": 1}, "sgd", STEPS, extra)[0]
    out = run_ranks(train_job, 2, {**layout, "micro_batch_size": 1}, "sgd", STEPS, extra)[0]
    for name in ("loss", "grad_norm"):
        got, want = torch.tensor(out[name]), torch.tensor(ref[name])
        assert ((got - want).abs() / want.abs()).max().item() < 1e-5, (name, got, want)
    plain = run_ranks(train_job, 1, {"micro_batch_size": 1}, "sgd", 1,
                      [f"data.source={data}", "train.lr=0.5", "model.n_layers=4"])[0]
    assert abs(plain["loss"][0] - ref["loss"][0]) > 1e-4  # EOS targets did drop out


def test_a_validation_set_is_checked_like_the_training_data(tmp_path: Path) -> None:
    """The validation loss applies the document mask too: a validation set whose documents
    end in another EOS is refused when the validator opens it, naming it."""
    from tenax.workers.evaluation import Validator

    def docs(name: str, eos: int) -> str:
        rng = np.random.default_rng(eos)
        with IndexedDatasetWriter(str(tmp_path / name), np.uint16) as writer:
            for _ in range(80):
                writer.add_document(rng.integers(1, EOS, size=12).tolist() + [eos])
        return str(tmp_path / name)

    good, bad = docs("good", EOS), docs("bad", 0)
    extra = [f"data.source={good}", "data.document_mask=true", f"data.eos_id={EOS}"]
    assert Validator(tiny_spec(extra + [f"data.validation={{uri: '{good}', steps: 1}}"]))
    with pytest.raises(ValueError, match=f"documents of {bad!r} do not end with eos id {EOS}"):
        Validator(tiny_spec(extra + [f"data.validation={{uri: '{bad}', steps: 1}}"]))
