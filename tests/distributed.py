"""Run a function on N gloo ranks in fresh processes on 127.0.0.1: `tenax.testing.ranks`, with
the suite's own modules preloaded in the ranks' forkserver."""
from __future__ import annotations

from tenax.testing.ranks import (init_gloo, preload_in_ranks, rank_context, run_ranks,
                                 shutdown_gloo)
from tenax.workers.rendezvous import free_port

__all__ = ["free_port", "init_gloo", "rank_context", "run_ranks", "shutdown_gloo"]

preload_in_ranks("pytest", "hypothesis", "tests.distributed")
