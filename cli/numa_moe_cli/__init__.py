"""The ``numa-moe`` command line: a thin shell over the numa_moe package API."""
