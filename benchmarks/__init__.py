"""The project's benchmarks (a regular package, so that ``benchmarks.population`` is this directory's even where an
installed distribution ships a top-level ``benchmarks`` package of its own, as opacus 1.6 does)."""
