"""Benchmarks, run from the repo root as `python -m bench.<name>` (see bench/README.md).

A package so the scripts and the tests share helpers through importable modules
(`bench.common`, `tests.ray_helpers`) instead of editing sys.path.
"""
