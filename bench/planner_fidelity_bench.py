"""Planner fidelity: the cost model's predicted bytes ÷ what a real step moves and holds.

    python -m bench.planner_fidelity_bench [--quick] [--json PATH]

Why: the planner ranks layouts with closed-form comm and memory formulas (parallel/cost_model.py);
if a formula is off for one parallelism, the planner picks the wrong layout after every
failure. So every parallelism runs one real training step on gloo ranks of the real engine
(`tenax.workers.trainer.Trainer`) and its collectives are counted:
- `CommCounter` (a TorchDispatchMode) sees every collective's input tensor; per-rank wire bytes
  follow the same ring conventions the cost model states (all-reduce 2(N-1)/N x input,
  all-gather (N-1) x its shard input, reduce-scatter (N-1)/N x input, send = input);
- CP: the ring's own `RingCommCounter` (bytes of K/V and dK/dV hops);
- EP: every MoE forward's `MoEStats` (a forward hook), for the bytes that really leave the rank.
Model-state memory (params, grads, AdamW state) per rank is measured from the local tensors and
compared with `model_state_memory` (fp32 AdamW ledger: 4 + 4 + 8 bytes per parameter).
Goal: every ratio 1.00. Each layout is a single parallel dimension of degree N on N ranks.
Reading a ratio: > 1 means the model over-charges (it plans for traffic that never happens).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import queue as queue_mod
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

TINY = ["model.n_layers=2", "model.dim=64", "model.n_heads=8", "model.n_kv_heads=4",
        "model.ffn_hidden=96", "model.seq_len=32", "model.vocab_size=128",
        "train.global_batch_size=8", "train.warmup_steps=0", "parallel.micro_batch_size=1"]
MOE = "model.moe={num_experts: 4, top_k: 2, capacity_factor: 4.0, aux_loss_coef: 0.05}"
DP_BATCH = 16  # global batch of the DP rows: 1 and 4 micro-batches at both dp2 and dp4


def dp_rows(n: int) -> list[tuple[str, dict[str, Any], list[str]]]:
    """dpN zero 0-3 with m = 1 and m = 4 micro-batches per step (name ends "zeroZ mM")."""
    return [(f"dp{n} zero{z} m{m}", {"dp": n, "zero": z, "micro_batch_size": DP_BATCH // (n * m)},
             [f"train.global_batch_size={DP_BATCH}"]) for z in range(4) for m in (1, 4)]


WORLD2 = [("tp2 L2", {"tp": 2, "zero": 0}, []),
          ("tp2 L3", {"tp": 2, "zero": 0}, ["model.n_layers=3"]),
          *dp_rows(2),
          ("pp2", {"pp": 2, "zero": 0}, []), ("cp2", {"cp": 2, "zero": 0}, []),
          ("ep2", {"dp": 2, "ep": 2, "zero": 0}, [MOE])]
WORLD4 = dp_rows(4)
WIRE = {"all_reduce": lambda b, n: 2 * (n - 1) / n * b, "all_gather": lambda b, n: (n - 1) * b,
        "reduce_scatter": lambda b, n: (n - 1) / n * b, "all_to_all": lambda b, n: (n - 1) / n * b,
        "send": lambda b, n: b, "broadcast": lambda b, n: b}


def _contributed_bytes(func: Any, args: tuple, kwargs: dict | None) -> tuple[int, str]:
    """Bytes this rank contributes to a collective, and their dtype, read from the op schema:
    the tensors of the argument named input*/inputs (c10d ops put the OUTPUT first, e.g.
    `_allgather_base_(output_tensor, input_tensor)`), else the first tensor argument."""
    import torch
    from torch.utils._pytree import tree_flatten

    names = [a.name for a in func._schema.arguments]
    values = list(args) + [(kwargs or {}).get(n) for n in names[len(args):]]
    chosen = [v for n, v in zip(names, values) if n.startswith("input")] or list(args)[:1]
    if not any(n.startswith("input") for n in names):
        tensors = [x for x in tree_flatten(list(args))[0] if isinstance(x, torch.Tensor)][:1]
    else:
        tensors = [x for x in tree_flatten(chosen)[0] if isinstance(x, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, str(tensors[0].dtype) if tensors else "none"


def _group_size(func: Any, args: tuple, kwargs: dict | None) -> int:
    """Size of the group a collective runs on (functional ops name it, c10d ops pass it)."""
    import torch.distributed as dist

    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, list(args) + [(kwargs or {}).get(n) for n in names[len(args):]]))
    if values.get("group_name"):
        return dist.distributed_c10d._resolve_process_group(values["group_name"]).size()
    group = values.get("process_group")
    if group is None:
        return 0
    return dist.ProcessGroup.unbox(group).size() if not hasattr(group, "size") else group.size()


def _detailed_counter() -> Any:
    from tenax.parallel.comm_counter import CommCounter, collective_kind

    @dataclass
    class DetailedCounter(CommCounter):
        """CommCounter plus correctly attributed input bytes, split by dtype (EP's int64
        count exchange vs token rows). The parent's own `bytes` are kept for comparison."""
        by_dtype: Counter = field(default_factory=Counter)
        calls: Counter = field(default_factory=Counter)
        wire: Counter = field(default_factory=Counter)  # per-rank ring bytes, by the op's group

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None):
            kind = collective_kind(func)
            if kind is not None:
                nbytes, dtype = _contributed_bytes(func, args, kwargs)
                key = f"{kind}|{dtype}"
                self.by_dtype[key] += nbytes
                self.calls[key] += 1
                n = _group_size(func, args, kwargs)
                if kind in WIRE and n:
                    self.wire[kind] += WIRE[kind](nbytes, n)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def by_kind(self) -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for key, nbytes in self.by_dtype.items():
                kind = key.split("|")[0]
                entry = out.setdefault(kind, {"count": 0, "bytes": 0, "wire": self.wire[kind]})
                entry["count"] += self.calls[key]
                entry["bytes"] += nbytes
            return out

    return DetailedCounter()


def _memory(trainer: Any, zero: int) -> dict[str, int]:
    from tenax.parallel.data_parallel import local

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = sum(nbytes(local(p)) for p in trainer.pm.parameters())
    if zero == 2:
        grads = sum(nbytes(g) for dp in trainer.pm.dps for _, g in dp.owned_grads())
    else:
        grads = sum(nbytes(local(p.grad)) for p in trainer.pm.parameters() if p.grad is not None)
    opt = sum(nbytes(local(v)) for state in trainer.optimizer.state.values()
              for k, v in state.items() if k != "step")
    return {"params": params, "grads": grads, "optimizer": opt}


def _watch_accumulated_grads(trainer: Any) -> dict[str, int]:
    """Record the grad bytes a rank holds when the last micro-batch begins (after m-1
    micro-batches of accumulation): the ledger's grads figure should hold at that peak too.
    Hand-written DP only (FSDP2 keeps its accumulated grads internally)."""
    peak: dict[str, int] = {}

    def watched(index: int, last: bool) -> None:
        if last and index > 0 and trainer.pm.dps:
            peak["grads"] = sum(dp.held_grad_bytes() for dp in trainer.pm.dps)

    trainer.on_micro_batch = watched
    return peak


def measure_config(layout: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """One warm-up step, then one counted step of `layout` (runs on every rank)."""
    from tenax.orchestrator.spec import load_spec
    from tenax.parallel.expert_parallel import is_expert_param, moe_layers
    from tenax.parallel.layout import ParallelLayout
    from tenax.workers.trainer import Trainer

    spec = load_spec(overrides=TINY + extra)
    trainer = Trainer(spec, ParallelLayout(**{"micro_batch_size": 1, **layout}))
    trainer.run_step()
    peak = _watch_accumulated_grads(trainer)
    cps = [p.cp_comm_counter for p in trainer.parts if hasattr(p, "cp_comm_counter")]
    for c in cps:
        c.reset()
    moe: list[Any] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: moe.append(mod.last_stats))
             for part in trainer.parts for _, m in moe_layers(part)]
    counter = _detailed_counter()
    with counter:
        trainer.run_step()
    for h in hooks:
        h.remove()
    experts = sum(p.numel() for n, p in trainer.pm.named_parameters() if is_expert_param(n))
    out = {"comm": counter.by_kind(), "comm_counter_raw": counter.summary(),
           "by_dtype": dict(counter.by_dtype),
           "cp_bytes": sum(c.total_bytes for c in cps),
           "cp_hops": sum(c.forward_hops + c.backward_hops for c in cps),
           "moe_sent": sum(s.a2a_bytes_sent for s in moe),
           "moe_remote": sum(s.a2a_remote_bytes_sent for s in moe),
           "moe_received": sum(s.a2a_bytes_received for s in moe),
           "moe_dropped": sum(s.dropped for s in moe),
           "memory": _memory(trainer, layout.get("zero", 1)), "accum": trainer.accum,
           "grads_before_last_micro_batch": peak.get("grads"),
           "n_params": spec.model.num_params(), "expert_params": experts}
    del trainer
    gc.collect()
    return out


def _rank_main(rank: int, world: int, port: int, configs: list, q: Any) -> None:
    try:
        import torch

        from tenax.workers.rendezvous import join_process_group, leave_process_group

        torch.set_num_threads(1)
        join_process_group(rank, world, "127.0.0.1", port, 120.0)
        results = {name: measure_config(layout, extra) for name, layout, extra in configs}
        leave_process_group()
        q.put((rank, "ok", results))
    except BaseException:  # report every failure with its traceback
        q.put((rank, "error", traceback.format_exc()))


def run_group(world: int, configs: list, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Run `configs` on `world` fresh gloo ranks; results by rank (raises with tracebacks)."""
    from tenax.workers.rendezvous import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, configs, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, payload = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def wire(comm: dict[str, dict[str, Any]], kinds: tuple[str, ...]) -> float:
    """Per-rank wire bytes of `kinds`, each op converted with its own group's size."""
    return sum(comm[k]["wire"] for k in kinds if k in comm)


def spec_of(extra: list[str]) -> Any:
    from tenax.orchestrator.spec import load_spec

    return load_spec(overrides=TINY + extra)


def comm_rows(report: Report, r2: dict[str, list[dict[str, Any]]]) -> None:
    from tenax.parallel.cost_model import cp_comm, pp_comm, tp_comm

    s = spec_of([])
    m, gb = s.model, s.train.global_batch_size
    l2, l3 = r2["tp2 L2"][0]["comm"], r2["tp2 L3"][0]["comm"]
    ag_rs = ("all_gather", "reduce_scatter")
    per_layer = wire(l3, ag_rs) - wire(l2, ag_rs)
    pred = tp_comm(gb, m.seq_len, m.dim, 2, 1, dtype_bytes=4).nbytes
    report.add("comm TP+SP, per layer", ratio(pred, per_layer), "== 1 ±0.01",
               f"{pred:.0f} B predicted vs {per_layer:.0f} B (3 layers - 2 layers)")
    step = wire(l2, ("all_gather", "reduce_scatter", "all_reduce"))
    norms = (2 * m.n_layers + 1) * m.dim * 4
    pred = tp_comm(gb, m.seq_len, m.dim, 2, m.n_layers, 4, vocab=m.vocab_size,
                   norm_grad_bytes=norms).nbytes
    report.add("comm TP+SP, whole step", ratio(pred, step), "== 1 ±0.01",
               f"{pred:.0f} vs {step:.0f} B: layers + embedding/head SP boundaries + logits "
               "all-gather + norms' grad all-reduce")
    sent = sum(r["comm"].get("send", {}).get("bytes", 0) for r in r2["pp2"])
    pred = pp_comm(1, m.seq_len, m.dim, r2["pp2"][0]["accum"], dtype_bytes=4).nbytes
    report.add("comm PP p2p, per boundary", ratio(pred, sent), "== 1 ±0.01",
               f"{pred:.0f} vs {sent:.0f} B sent by both stages")
    msgs = sum(r["comm"].get("send", {}).get("count", 0) for r in r2["pp2"])
    pred_steps = pp_comm(1, m.seq_len, m.dim, r2["pp2"][0]["accum"], dtype_bytes=4).steps
    report.add("comm PP p2p, messages (latency steps)", ratio(pred_steps, msgs), "== 1 ±0.01",
               f"{pred_steps:.0f} vs {msgs}")
    cp = r2["cp2"][0]
    pred = cp_comm(gb, m.seq_len, m.n_kv_heads, m.head_dim, 2, m.n_layers, 4, cp["accum"])
    report.add("comm CP ring", ratio(pred.nbytes, cp["cp_bytes"]), "== 1 ±0.01",
               f"{pred.nbytes:.0f} vs {cp['cp_bytes']:.0f} B")
    report.add("comm CP ring, hops (latency steps)", ratio(pred.steps, cp["cp_hops"]),
               "== 1 ±0.01", f"{pred.steps:.0f} vs {cp['cp_hops']}: a ring per micro-batch "
               f"({cp['accum']} per step)")
    ep_rows(report, r2["ep2"])
    dp_comm_rows(report, r2)


def dp_comm_rows(report: Report, results: dict[str, list[dict[str, Any]]]) -> None:
    from tenax.parallel.cost_model import dp_comm

    for name, runs in results.items():
        if not name.startswith("dp"):
            continue
        n, zero = int(name[2]), int(name.split()[1][-1])
        got = wire(runs[0]["comm"], ("all_reduce", "all_gather", "reduce_scatter"))
        pred = dp_comm(4 * runs[0]["n_params"], n, zero, microbatches=runs[0]["accum"]).nbytes
        report.add(f"comm DP {name}", ratio(pred, got), "== 1 ±0.01",
                   f"{pred:.0f} vs {got:.0f} B; {runs[0]['accum']} micro-batches/step")


def ep_rows(report: Report, runs: list[dict[str, Any]]) -> None:
    from tenax.parallel.cost_model import ep_comm

    s = spec_of([MOE])
    m, n = s.model, 2
    pred = ep_comm(s.train.global_batch_size // n, m.seq_len, m.dim, m.moe.top_k, n, m.n_layers,
                   dtype_bytes=4)
    volume = statistics.mean(sum(v for k, v in r["by_dtype"].items()
                                 if k.startswith("all_to_all|") and "int64" not in k) for r in runs)
    report.add("comm EP all-to-all, volume", ratio(pred.nbytes / ((n - 1) / n), volume),
               "== 1 ±0.01", f"token rows handed to the 4 all-to-alls per MoE layer, mean of "
               f"ranks; {sum(r['moe_dropped'] for r in runs)} dropped")
    # Bytes that leave a rank: dispatch (remote rows) and combine (rows sent back to remote
    # sources), forward, and the same again backward.
    leaving = statistics.mean(2 * (r["moe_remote"] + r["moe_received"] - r["moe_sent"]
                                   + r["moe_remote"]) for r in runs)
    report.add("comm EP all-to-all, leaving rank", ratio(pred.nbytes, leaving), "== 1 ±0.01",
               "mean of ranks; the model assumes uniform routing ((N-1)/N of rows leave)")


def memory_rows(report: Report, results: dict[str, list[dict[str, Any]]]) -> None:
    from tenax.parallel.cost_model import FP32_ADAMW, model_state_memory

    for name, runs in results.items():
        if name == "tp2 L3":
            continue
        layout = next(lay for nm, lay, _ in WORLD2 + WORLD4 if nm == name)
        deg = {k: layout.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")}
        ledger = model_state_memory(runs[0]["n_params"], zero=layout["zero"], state=FP32_ADAMW,
                                    expert_params=runs[0]["expert_params"], **deg)
        ratios = [ledger.model_states / sum(r["memory"].values()) for r in runs]
        spread = "/".join(f"{x:.3f}" for x in ratios)
        worst = max(ratios, key=lambda x: abs(x - 1))
        report.add(f"memory {name}", worst, "== 1 ±0.01",
                   f"per rank {spread}; {ledger.model_states / 2**20:.2f} MiB predicted")
        peak = runs[0].get("grads_before_last_micro_batch")
        if name.startswith("dp") and peak:
            report.add(f"memory {name}, grads during accumulation", ratio(ledger.grads, peak),
                       "== 1 ±0.01", f"{ledger.grads:.0f} vs {peak} B held before the last "
                       "micro-batch")


def main() -> int:
    args = parse_args(__doc__)
    results: dict[str, list[dict[str, Any]]] = {}
    per_rank = run_group(2, WORLD2)
    results.update({name: [r[name] for r in per_rank] for name, _, _ in WORLD2})
    if not args.quick:
        per_rank = run_group(4, WORLD4)
        results.update({name: [r[name] for r in per_rank] for name, _, _ in WORLD4})
    report = Report("Planner fidelity: cost model ÷ measured, one real step per parallelism")
    comm_rows(report, results)
    memory_rows(report, results)
    report.context = {"quick": args.quick, "model": TINY, "moe": MOE,
                      "measured": {k: [{kk: vv for kk, vv in r.items()} for r in v]
                                   for k, v in results.items()}}
    report.finish(args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
