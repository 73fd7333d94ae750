"""perfgate: a pytest plugin that gates optimized kernels on their speedup over a reference.

It imports nothing else of kernelgate, so any project that installs kernelgate can use it:

- ``plugin``: options, the ``perf`` fixture, the ``speedup`` marker, the gate (entry point pytest11).
- ``timing``: device-correct timing helpers and peak-memory measurement.
- ``stats``: the speedup statistic (ratio of medians, bootstrap interval) and the gate rules.
- ``fingerprint``: what makes two machines comparable.
- ``report``: ``python -m kernels.perfgate.report`` prints the table and draws the charts.

Nothing heavy is imported here: torch, scipy and matplotlib load only when used.
"""
