"""The benchmarks behind docs/benchmarks.md, each run as a module from the repository's root
(`python -m bench.offline`), importing the engine's packages and the test doubles of tests/ by
their names. Never installed (pyproject.toml lists the engine's packages only)."""
