"""Benchmarks behind ``kvtier bench``. Each reports ratios to a limit measured in the same run."""
