"""What each workload's reference run is made of: the slow, obviously correct pieces (reference
kernels, Python optimizers, the plain loop). ``workloads/X.py`` assembles and times them beside
the optimized run; nothing here imports ``workloads``."""
