"""Benchmarks (never tests): kvstate against a reference, in one process, on the same inputs.

Absolute times on shared machines are noise; ratios measured in one run are not. Every
benchmark also prints the fraction of this machine's limits it reaches (measured fp32 GEMM
FLOP/s for compute-bound forms, measured memory bandwidth for decode).
"""
