"""Every exception the parallel layer raises, in one torch-free module.

Why one module: the controller, the CLI and the rank loop catch a failed plan or an impossible
layout without importing the planner or the engine. Both derive from ValueError (a bad request,
not a failure of the machine) and take only a message, so they pickle across Ray actors.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class PlanError(ValueError):
    """No layout can run this model on these GPUs; the message says what was closest."""


class LayoutError(ValueError):
    """A layout that cannot run this model on this many ranks; the message says why."""
