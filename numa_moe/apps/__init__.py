"""The library code of the numa-moe commands (run, generate, simulate, inspect, bench):
each a client of the layers below, none used by them. The CLI (cli/numa_moe_cli) is a
thin shell over these."""
