"""Benchmarks, run from the repository root as `python -m bench.<name>` (docs/benchmarks.md).

A package so that the scripts share helpers through importable modules (`bench.common`, and
`tenax.testing` for Ray and jobs, which the test suite uses too) instead of editing sys.path.
Run as a path (`python bench/<name>.py`), a script exits with status 2 and says how to run it.
The tests of the benches' own measuring code are in `bench/tests/`.
"""
