"""perfgate: a pytest plugin that gates optimized kernels on their speedup over a reference.

Its own distribution (``pip install ./perfgate``, ``pytest-perfgate``), for any project with
reference/optimized pairs; torch is optional. Inert in a session that has no perf test.

- ``plugin``: the pytest hooks and fixtures (entry point pytest11), each delegating to
- ``options``: the ``--perf-*`` options, and ``Options``, one session's values, checked.
- ``session``: ``PerfSession``, when the gate starts, the verdict and its report.
- ``compat``: every use of pytest-benchmark beyond its documented API.
- ``case``: ``PerfCase``, what the ``perf`` fixture gives a test, and the timing call.
- ``state``: ``GateState``, one session's parts: its ``Settings``, ``Probes`` (clock, host
  readings, thread pools), ``Floors``, ``Stored`` baseline, ``Later`` visits and ``Tally``, and
  what it measured; the later visits, extensions and second looks are timed there.
- ``timing``: device-correct timing helpers and peak-memory measurement.
- ``roofline``: the work one call is counted to do, the machine's measured limits, and each
  impl's share of them (the roofline column).
- ``stats``: the speedup statistic (ratio of medians, bootstrap interval) and the gate rules.
- ``fingerprint``: what makes two machines comparable.
- ``report``: ``python -m perfgate.report`` prints the table and draws the charts, and
  ``--merge`` makes the shards of one run one table and one verdict.
- ``shard``: ``--perf-shard K/N``'s split of the suite, and the merge's checks.

Nothing heavy is imported here: torch, scipy and matplotlib load only when used.
"""
