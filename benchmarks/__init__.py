"""Benchmarks: each compares against baselines measured in the same run and prints ratios."""
