"""The first module an agent's forkserver imports: it turns the cyclic garbage collector off
for the rest of the forkserver's life.

Why: importing torch, Ray and the engine allocates ~10^6 objects, and the collector ran full
passes over the growing heap all along (about a fifth of the import's CPU). Nothing the
forkserver allocates is ever freed, so it gives nothing back. A training process forked from
it freezes what it inherited and turns the collector on again (`worker._child_main`).
"""
from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

gc.disable()
