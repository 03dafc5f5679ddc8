"""`tenax export hf` cost and HF parity, side by side in one run.

    python -m bench.hf_bench [--quick] [--json PATH]

Rows:
- export time ÷ `safetensors.torch.save_file` of the same tensors already in memory (same
  dtype, same disk): what reading the checkpoint through the resharding load path and
  streaming it costs over the floor of just writing the bytes (goal <= 2).
- export peak RSS growth ÷ the largest shard written: measured in a fresh subprocess (peak
  RSS reset through /proc/self/clear_refs after imports, growth = VmHWM - VmRSS before the
  export), so it counts what the export holds, not the interpreter (goal <= 3).
- HF logits vs Tenax logits, max relative error (max |a-b| / max |b|): after export of a dp2,
  tp2, pp2 and zero-3 checkpoint (transformers loads the directory; Tenax runs the gathered
  parameters), and after import (`model.init_from` of an HF model into those layouts; Tenax
  runs the parameters each layout started from) (goal <= 1e-5). The same for an MoE model
  as Mixtral: export of an ep2 checkpoint, import into ep2 (capacity_factor = num_experts /
  top_k, so Tenax drops nothing and matches HF's dropless Mixtral).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tenax.testing.checkpoint_jobs import save_one_step
from tenax.testing.scripts import exit_unless_run_as_module

exit_unless_run_as_module(__spec__, __file__)  # a path run stops here, before `bench.`

from bench.common import Report, parse_args, ratio

logger = logging.getLogger(__name__)

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.vocab_size=128", "model.ffn_hidden=96", "model.seq_len=16",
        "train.global_batch_size=4", "train.warmup_steps=0", "parallel.micro_batch_size=1",
        "resources.device=cpu"]
LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "zero3": {"dp": 2, "zero": 3}}
MOE = ["model.moe={num_experts: 4, top_k: 2, capacity_factor: 2.0}"]
EP2 = {"dp": 2, "ep": 2}


def _spec(overrides: list[str]) -> Any:
    from tenax.workers import load_spec

    return load_spec(overrides=overrides)


def save_job(rank: int, world: int, uri: str, layout: dict[str, Any],
             overrides: list[str]) -> dict[str, torch.Tensor] | None:
    """One step in `layout`, a synchronous save; rank 0 returns the gathered parameters."""
    return save_one_step(rank, world, uri, layout, overrides)


def import_job(rank: int, world: int, layout: dict[str, Any],
               overrides: list[str]) -> dict[str, torch.Tensor] | None:
    """The parameters a trainer with model.init_from starts from (gathered on rank 0)."""
    from tenax.parallel import ParallelLayout
    from tenax.workers.trainer import Trainer

    trainer = Trainer(_spec(overrides), ParallelLayout(**{"micro_batch_size": 1, **layout}))
    full = trainer.full_params()
    return full if rank == 0 else None


def tenax_logits(overrides: list[str], params: dict[str, torch.Tensor],
                 tokens: torch.Tensor) -> torch.Tensor:
    from tenax.parallel import Transformer, tie_output

    with torch.device("meta"):
        model = Transformer(_spec(overrides).model.args())
    model.to_empty(device="cpu")
    tie_output(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
        return model(tokens).float()


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the directory's model (Llama or Mixtral, as its config.json says)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _world(layout: dict[str, int]) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


def parity(report: Report, root: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tenax.testing.ranks import run_ranks
    from tenax.workers.hf import export_hf

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, layout in LAYOUTS.items():
        uri = f"file://{root}/{name}"
        params = run_ranks(save_job, _world(layout), uri, layout, TINY, timeout_s=600)[0]
        export_hf(uri, str(root / f"hf-{name}"), dtype="float32")
        report.add(f"export {name}: logits max rel err",
                   rel_err(hf_logits(str(root / f"hf-{name}"), tokens),
                           tenax_logits(TINY, params, tokens)), "<= 1e-5")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                 max_position_embeddings=16, rms_norm_eps=1e-5,
                                 rope_theta=500000.0)).save_pretrained(str(root / "hf-src"))
    reference = hf_logits(str(root / "hf-src"), tokens)
    overrides = TINY + [f"model.init_from={root / 'hf-src'}", "model.from_hf=true"]
    for name, layout in LAYOUTS.items():
        params = run_ranks(import_job, _world(layout), layout, overrides, timeout_s=600)[0]
        report.add(f"import {name}: logits max rel err",
                   rel_err(tenax_logits(overrides, params, tokens), reference), "<= 1e-5")
    moe_parity(report, root, tokens)


def moe_parity(report: Report, root: Path, tokens: torch.Tensor) -> None:
    """An MoE model as Mixtral, out of and into ep2 (experts sharded over two ranks)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tenax.testing.ranks import run_ranks
    from tenax.workers.hf import export_hf

    uri = f"file://{root}/moe-ep2"
    params = run_ranks(save_job, 2, uri, EP2, TINY + MOE, timeout_s=600)[0]
    export_hf(uri, str(root / "hf-moe"), dtype="float32")
    report.add("export ep2 MoE as Mixtral: logits max rel err",
               rel_err(hf_logits(str(root / "hf-moe"), tokens),
                       tenax_logits(TINY + MOE, params, tokens)), "<= 1e-5")
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=128, max_position_embeddings=16,
                                     rms_norm_eps=1e-5, rope_theta=500000.0,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None)).save_pretrained(str(root / "mx-src"))
    overrides = TINY + [f"model.init_from={root / 'mx-src'}", "model.from_hf=true",
                        "model.moe.capacity_factor=2.0"]
    params = run_ranks(import_job, 2, EP2, overrides, timeout_s=600)[0]
    report.add("import ep2 Mixtral: logits max rel err",
               rel_err(tenax_logits(overrides, params, tokens),
                       hf_logits(str(root / "mx-src"), tokens)), "<= 1e-5")


RSS_SCRIPT = """
import ctypes, json, sys
from tenax.workers.hf import export_hf
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
ckpt, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
export_hf(ckpt, out + "-warm", dtype="bfloat16", shard_bytes=shard)  # lazy imports, first use
ctypes.CDLL(None).malloc_trim(0)  # hand the warm-up's freed heap back: count this export only
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS:")
result = export_hf(ckpt, out, dtype="bfloat16", shard_bytes=shard)
print(json.dumps({"base": base, "peak": status("VmHWM:"), "files": result.files,
                  "total": result.total_bytes}))
"""


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def export_times(uri: str, root: Path, shard: int, reps: int,
                 dtype: str) -> tuple[float, float, int]:
    """Best of `reps` interleaved runs: export vs save_file of the exported tensors (in
    memory, same dtype, same disk). Interleaved and best-of because the host is shared."""
    from safetensors.torch import load_file, save_file

    from tenax.workers.hf import export_hf

    out = root / f"timed-{dtype}"
    result = export_hf(uri, str(out), dtype=dtype, shard_bytes=shard)  # warm the page cache
    loaded = [load_file(str(out / f)) for f in result.files]
    exports, floors = [], []
    for _ in range(reps):
        exports.append(_timed(lambda: export_hf(uri, str(out), dtype=dtype, shard_bytes=shard)))
        floors.append(_timed(lambda: [save_file(t, str(root / f"floor-{f}"),
                                                metadata={"format": "pt"})
                                      for t, f in zip(loaded, result.files)]))
    return min(exports), min(floors), result.total_bytes


def export_cost(report: Report, root: Path, quick: bool) -> None:
    from tenax.testing.ranks import run_ranks

    dims = (["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
             "model.ffn_hidden=1536", "model.vocab_size=16384"] if quick else
            ["model.dim=1024", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8",
             "model.ffn_hidden=2816", "model.vocab_size=32000"])
    overrides = TINY + dims + ["model.seq_len=32", "train.global_batch_size=2"]
    uri = f"file://{root}/big"
    run_ranks(save_job, 1, uri, {"dp": 1}, overrides, timeout_s=900)
    out = root / "big-hf"
    # Shards of about a third of the model, so "largest shard" is not the whole model.
    shard = (30 if quick else 120) * 10**6
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, uri, str(out), str(shard)],
                          capture_output=True, text=True, timeout=900, check=True)
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    largest = max(os.path.getsize(out / f) for f in doc["files"])
    for dtype in ("bfloat16", "float32"):  # float32: no cast, the streaming alone
        export_s, floor_s, size = export_times(uri, root, shard, 2 if quick else 3, dtype)
        report.add(f"export time ÷ save_file of the tensors in memory ({dtype})",
                   ratio(export_s, floor_s), "<= 2",
                   f"{size / 1e6:.0f} MB; export {export_s:.2f} s, save_file "
                   f"{floor_s:.2f} s (best of interleaved)")
    report.add("export peak RSS growth ÷ largest shard", ratio(doc["peak"] - doc["base"],
                                                                largest), "<= 3",
               f"growth {(doc['peak'] - doc['base']) / 1e6:.0f} MB, largest shard "
               f"{largest / 1e6:.0f} MB (fresh process, after imports)")


def main() -> None:
    args = parse_args(__doc__)
    report = Report("HF export/import: cost and parity")
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        export_cost(report, Path(tmp), args.quick)
        parity(report, Path(tmp))
    report.finish(args.json_path)


if __name__ == "__main__":
    main()
