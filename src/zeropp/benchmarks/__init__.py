"""Benchmarks run from the command line (``zeropp bench ...``)."""
