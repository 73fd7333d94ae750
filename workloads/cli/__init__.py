"""One command-line entry point per workload: ``python -m workloads.cli.<name>``."""
