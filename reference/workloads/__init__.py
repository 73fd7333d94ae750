"""Reference runs of the workloads."""
