"""The workloads end to end: data, the optimized run, its ablation."""
