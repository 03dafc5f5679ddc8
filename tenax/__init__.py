"""Tenax: a fault-tolerant, elastic training orchestrator for long LLM pretraining runs.

One import package; its sub-packages are the repository's role folders (see `setup.py`):
- `tenax.parallel` — layouts, the planner's cost model, the Llama model, one module per
  parallelism and `parallelize` applying them in a fixed order.
- `tenax.checkpoint` — storage checkpoints (format, save, load) and in-memory snapshots.
- `tenax.workers` — the job spec, the rank agent (a Ray actor), the rank loop, data, events.
- `tenax.orchestrator` — the job controller, placement and recovery, the `tenax serve` service,
  the command line and fault injection for drills.
- `tenax.proto` — the `tenax.v1` gRPC messages and service stubs.
- `tenax.testing` — real-Ray job harness shared by the test suite and the benchmarks.

Imports point one way: orchestrator -> workers -> checkpoint -> parallel.
"""
__version__ = "0.1.0"
__all__ = ["checkpoint", "orchestrator", "parallel", "proto", "workers", "__version__"]
