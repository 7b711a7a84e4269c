"""Options: one frozen dataclass per concern, every field validated with its range named."""

import dataclasses

import pytest

import spmd
from spmd.options import SearchOptions, SolverOptions


@pytest.mark.parametrize("kwargs, match", [
    ({"time_limit": 0}, r"SearchOptions.time_limit must be > 0 \(seconds\), got 0"),
    ({"time_limit": float("nan")}, r"SearchOptions.time_limit must be > 0"),
    ({"memory_budget": -1.0}, r"SearchOptions.memory_budget must be > 0 \(bytes per device\)"),
    ({"score_time_limit": -2}, r"SearchOptions.score_time_limit must be > 0"),
    ({"compare": "yes"}, r"SearchOptions.compare must be True or False, got 'yes'"),
    ({"rules": ["mlp"]}, r"SearchOptions.rules: rule 0 is .mlp., not a \(logical name, mesh axes\) pair"),
    ({"solver": {"gap": 0.1}}, r"SearchOptions.solver must be a SolverOptions"),
])
def test_search_options_name_the_bad_field(kwargs, match):
    with pytest.raises(spmd.OptionsError, match=match):
        SearchOptions(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"gap": 1.0}, r"SolverOptions.gap must be in \[0, 1\), got 1.0"),
    ({"solve_share": 0}, r"SolverOptions.solve_share must be in \(0, 1\]"),
    ({"workers": 0}, r"SolverOptions.workers must be an integer >= 1, got 0"),
    ({"workers": 1.5}, r"SolverOptions.workers must be an integer >= 1"),
    ({"presolve_limit": -1}, r"SolverOptions.presolve_limit must be an integer >= 0"),
    ({"stall_gain": -0.1}, r"SolverOptions.stall_gain must be a number >= 0"),
    ({"refine": 1}, r"SolverOptions.refine must be True or False"),
])
def test_solver_options_name_the_bad_field(kwargs, match):
    with pytest.raises(spmd.OptionsError, match=match):
        SolverOptions(**kwargs)


def test_options_are_frozen_with_one_default_each():
    options = SearchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.time_limit = 3.0  # type: ignore[misc]
    assert SearchOptions.time_limit == options.time_limit == 20.0
    limit, scoring = SearchOptions(time_limit=0.5).scoring()
    assert limit == 0.5 and scoring.refine is False and options.solver.refine is True
    limit, scoring = SearchOptions(score_refine=True, score_time_limit=5.0).scoring()
    assert limit == 5.0 and scoring.refine is True
    assert SolverOptions().stall_window(100.0) == 5.0 and SolverOptions().stall_window(1.0) == 1.0
