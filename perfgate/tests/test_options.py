"""perfgate.options: the ``--perf-*`` values as the command line gives them, and each one checked
at its bounds when a session reads them (a bad one is a usage error naming it); no session runs."""

from __future__ import annotations

import types
from typing import Any

import pytest

from perfgate.options import OPTIONS, Options


def _read(**given: Any) -> Options:
    """``Options.read`` of the defaults with ``given`` (by dest: perf_tolerance=0.5)."""
    values = {flag.removeprefix("--").replace("-", "_"): default for flag, default, _ in OPTIONS}
    assert set(given) <= set(values)
    return Options.read(types.SimpleNamespace(getoption={**values, **given}.__getitem__))


def test_the_defaults_ask_for_nothing_and_any_option_given_does() -> None:
    assert not _read().asked
    assert _read(perf_visits=2).asked and _read(perf_l2_flush=True).asked


def test_each_value_is_accepted_at_its_bound() -> None:
    edge = _read(perf_tolerance=0.0, perf_threads=1, perf_visits=1, perf_extend=0.0, perf_contended=1e-9,
                 perf_shard="2/2")
    assert (edge.tolerance, edge.threads, edge.visits, edge.extend_s) == (0.0, 1, 1, 0.0)
    assert edge.contended == 1e-9 and edge.shard == (2, 2)


@pytest.mark.parametrize(("given", "message"), [
    ({"perf_tolerance": 1.0}, "--perf-tolerance must be in [0, 1), got 1.0"),
    ({"perf_tolerance": -0.1}, "--perf-tolerance must be in [0, 1), got -0.1"),
    ({"perf_threads": 0}, "--perf-threads must be >= 1, got 0"),
    ({"perf_visits": 0}, "--perf-visits must be >= 1, got 0"),
    ({"perf_extend": -1.0}, "--perf-extend must be seconds >= 0, got -1.0"),
    ({"perf_contended": 0.0}, "--perf-contended must be a share > 0 (inf: never), got 0.0"),
    ({"perf_shard": "3/2"}, "--perf-shard must be K/N with 1 <= K <= N (e.g. 1/2), got '3/2'"),
])
def test_a_value_past_its_bound_is_a_usage_error_naming_it(given: dict, message: str) -> None:
    with pytest.raises(pytest.UsageError) as error:
        _read(**given)
    assert str(error.value) == message


def test_the_command_line_gives_typed_values_switches_and_checked_choices(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig("--perf-tolerance=0.6", "--perf-visits=2", "--perf-l2-flush", "--perf-size=full")
    assert config.getoption("perf_tolerance") == 0.6 and config.getoption("perf_visits") == 2
    assert config.getoption("perf_l2_flush") is True and config.getoption("perf_all_visits") is False
    assert config.getoption("perf_size") == "full"
    with pytest.raises(pytest.UsageError, match="invalid choice: 'huge'"):
        pytester.parseconfig("--perf-size=huge")
