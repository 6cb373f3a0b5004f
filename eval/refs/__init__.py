"""Reference generators: each runs a model family's own code (openpi, transformers, ...) from a side venv and
writes arrays or timings that this repository compares against. Not imported by the library or the tests, which
read only what these commands write."""
