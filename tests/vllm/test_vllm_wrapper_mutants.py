"""Seeded mutants of the wrapper of a vLLM manager behind statecore's scheduler
(:data:`catalogue.VLLM_WRAPPER_MUTANTS`): each must fail the tests of the rule it breaks in
``test_vllm_wrappers.py``, which the unmodified wrapper passes. Runs in vLLM's venv
(scripts/vllm-integration.sh)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

import test_vllm_wrappers as rules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mutants"))
from catalogue import VLLM_WRAPPER_MUTANTS

CAUGHT_BY: dict[str, tuple[Callable[[], None], ...]] = {
    "spec_refusal_not_undone": (
        rules.test_a_refused_store_spec_gives_the_room_back,
        rules.test_a_refused_load_spec_releases_its_pins,
    ),
    "spec_stats_not_taken": (rules.test_the_spec_wrapper_takes_the_managers_stats,),
    "reset_flush_never_sent": (
        rules.test_the_reset_flush_reaches_a_vllm_manager_behind_statecores_scheduler,
        rules.test_the_reset_flush_comes_before_the_schedule_end_it_rides,
    ),
}
"""Per mutant: the rule tests that must each fail with it."""


def test_every_mutant_has_its_rule_tests() -> None:
    assert set(CAUGHT_BY) == set(VLLM_WRAPPER_MUTANTS)


@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_the_rule_tests_pass_without_the_mutant(name: str) -> None:
    for rule in CAUGHT_BY[name]:
        rule()


@pytest.mark.parametrize("name", sorted(CAUGHT_BY))
def test_the_mutant_is_caught_by_each_of_its_rule_tests(name: str) -> None:
    for rule in CAUGHT_BY[name]:
        with VLLM_WRAPPER_MUTANTS[name].apply(), pytest.raises(AssertionError):
            rule()
