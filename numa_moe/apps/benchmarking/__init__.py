"""Benchmarks shared by ``benchmarks/`` scripts and the ``numa-moe bench`` commands."""
