"""Drop-in integrations of the NUMA-partitioned MoE layer into model libraries."""
