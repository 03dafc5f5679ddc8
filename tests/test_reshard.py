"""Save under one layout, load under another: every tensor survives, and training continues
exactly as the uninterrupted run.

Each chain runs in one set of spawned ranks (see tests/ckpt_jobs.py): phase k loads what phase
k-1 saved, in a different layout and often a different world size, so every transition
checks (1) every model parameter and AdamW moment, gathered to full tensors, equals what was
saved, bit for bit; (2) step and data cursor were restored; (3) the loss of the next step equals
the uninterrupted single-rank run's (rel 1e-5, the engine's parity tolerance).
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ckpt_jobs import MOE, chain_job, ckpt_spec, train_losses, world_of
from tests.distributed import run_ranks

L = dict  # a layout; micro_batch_size 1 is added by the job
DENSE = [L(dp=4, zero=1), L(dp=3, zero=1), L(dp=2, tp=2, zero=0), L(dp=4, zero=3),
         L(dp=2, pp=2, zero=0), L(dp=2, cp=2, zero=1), L(dp=2, zero=2)]
EXPERTS = [L(dp=2, ep=2, zero=1), L(dp=4, ep=1, zero=3), L(dp=4, ep=2, zero=2),
           L(dp=2, ep=1, zero=0)]


def name(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in layout.items())


@functools.lru_cache(maxsize=None)
def reference(moe: bool, steps: int) -> tuple[float, ...]:
    return tuple(run_ranks(train_losses, 1, steps, MOE if moe else [])[0])


def run_chain(layouts: list[dict], root: str, extra: list[str]) -> list[dict]:
    phases = [{"layout": layout, "steps": 1} for layout in layouts]
    world = max(world_of(layout) for layout in layouts)
    out = run_ranks(chain_job, world, phases, f"file://{root}/ckpt", root, extra,
                    timeout_s=300)
    return out[0]


def check_transition(before: dict, after: dict, ref: tuple[float, ...]) -> None:
    saved_step = before["trainer_step_after_load"] + 1
    assert after["loaded_step"] == saved_step
    assert after["trainer_step_after_load"] == saved_step
    assert after["cursor_after_load"] == saved_step * 12  # global batch 12 per step
    saved, loaded = before["saved"], after["loaded"]
    assert saved.keys() == loaded.keys()
    assert any(k.endswith(".exp_avg_sq") for k in saved) and "optim.step" in saved
    for key, want in saved.items():
        got = loaded[key]
        assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{key}: max abs diff {(got - want).abs().max():.3e}"
    for step, loss in after["losses"].items():
        rel = abs(loss - ref[step - 1]) / abs(ref[step - 1])
        assert rel < 1e-5, f"step {step}: loss {loss} vs uninterrupted {ref[step - 1]} ({rel:.1e})"


@pytest.fixture(scope="module")
def dense_chain(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_chain(DENSE, str(tmp_path_factory.mktemp("dense")), [])


@pytest.fixture(scope="module")
def expert_chain(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_chain(EXPERTS, str(tmp_path_factory.mktemp("experts")), MOE)


@pytest.mark.parametrize("i", range(1, len(DENSE)),
                         ids=[f"{name(a)}->{name(b)}" for a, b in zip(DENSE, DENSE[1:])])
def test_dense_reshard(dense_chain: list[dict], i: int) -> None:
    check_transition(dense_chain[i - 1], dense_chain[i], reference(False, len(DENSE)))


@pytest.mark.parametrize("i", range(1, len(EXPERTS)),
                         ids=[f"{name(a)}->{name(b)}" for a, b in zip(EXPERTS, EXPERTS[1:])])
def test_expert_reshard(expert_chain: list[dict], i: int) -> None:
    check_transition(expert_chain[i - 1], expert_chain[i], reference(True, len(EXPERTS)))


def test_first_phase_started_fresh_and_saves_were_committed(dense_chain: list[dict]) -> None:
    assert dense_chain[0]["loaded_step"] is None and dense_chain[0]["loaded"] is None
    for phase in dense_chain:
        commits = [e for e in phase["events"] if e["event"] == "checkpoint"]
        assert len(commits) == 1, phase["events"]
        assert 0 <= commits[0]["blocked_s"] <= commits[0]["total_s"]


def _valid_layouts() -> list[dict]:
    spec = ckpt_spec("memory://unused")
    from tenax.parallel.layout import ParallelLayout

    out = []
    for dp in (1, 2, 3, 4):
        for tp in (1, 2):
            for pp in (1, 2):
                for cp in (1, 2):
                    for zero in (0, 1, 2, 3):
                        layout = L(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero)
                        if world_of(layout) > 4:
                            continue
                        full = ParallelLayout(micro_batch_size=1, **layout)
                        if not full.problems(spec.model.args(), full.world_size,
                                             spec.train.global_batch_size):
                            out.append(layout)
    return out


VALID = _valid_layouts()


@pytest.mark.slow  # four reshards of random layout pairs: ~10 s
@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=st.tuples(st.sampled_from(VALID), st.sampled_from(VALID)).filter(
    lambda p: p[0] != p[1]))
def test_random_layout_pairs(pair: tuple[dict, dict], tmp_path_factory) -> None:
    root = str(tmp_path_factory.mktemp("pair"))
    out = run_chain(list(pair), root, [])
    check_transition(out[0], out[1], reference(False, 2))


@pytest.mark.parametrize("impl", [{"fused": True}, {"foreach": False}])
def test_a_loaded_step_count_sits_where_its_optimizer_keeps_it(impl):
    """A fused AdamW (the engine's on GPUs) keeps its step count on the parameter's device, the
    per-tensor loop on the host; what a load installs must step on in either."""
    from tenax.checkpoint.load.reshard import step_for

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1, **impl)
    step = torch.tensor(5.0)
    installed = step_for(optimizer, step, param)
    assert installed is not step and installed.device == param.device
    optimizer.state[param] = {"step": installed, "exp_avg": torch.zeros(3),
                              "exp_avg_sq": torch.zeros(3)}
    param.grad = torch.ones(3)
    optimizer.step()
    assert optimizer.state[param]["step"].item() == 6.0 and step.item() == 5.0
    assert param.detach().lt(1.0).all()  # the update ran from the loaded state
