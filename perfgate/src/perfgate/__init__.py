"""perfgate: a pytest plugin that gates optimized kernels on their speedup over a reference.

It imports nothing else of kernelgate, so any project that installs kernelgate can use it:

- ``plugin``: options, fixtures, the ``speedup`` marker, the verdict (entry point pytest11).
- ``case``: ``PerfCase``, what the ``perf`` fixture gives a test, and the timing call.
- ``state``: what one session measured, its floors and the stored baseline's speedups.
- ``timing``: device-correct timing helpers and peak-memory measurement.
- ``stats``: the speedup statistic (ratio of medians, bootstrap interval) and the gate rules.
- ``fingerprint``: what makes two machines comparable.
- ``report``: ``python -m perfgate.report`` prints the table and draws the charts.

Nothing heavy is imported here: torch, scipy and matplotlib load only when used.
"""
