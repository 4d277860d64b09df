"""Benchmarks: each prints our figure next to a reference measured in the same run."""
