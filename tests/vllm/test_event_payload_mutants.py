"""Seeded mutants of the vLLM adapter's self-describing KV-event payloads
(:data:`catalogue.EVENT_PAYLOAD_MUTANTS`): each must fail the payload oracle
(:mod:`kv_event_oracle`) on the engine runs made for it, which the unmodified adapter passes.
Runs in vLLM's venv (scripts/vllm-integration.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# "vllm.config", not "vllm": without vLLM, this very folder (tests/vllm, on sys.path through
# pytest's rootdir insertion) would import as an empty namespace package named vllm.
pytest.importorskip(
    "vllm.config", reason="vLLM 0.33 is not installed (build it: scripts/vllm-integration.sh)"
)

from kv_event_oracle import PAYLOAD_SCENARIOS, scenario_findings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mutants"))
from catalogue import EVENT_PAYLOAD_MUTANTS


def oracle_finding() -> str | None:
    """The oracle's first finding over the payload scenarios, in order (None: it passed)."""
    for name in PAYLOAD_SCENARIOS:
        findings = scenario_findings(name)
        if findings:
            return f"{name}: {len(findings)} findings, first: {findings[0]}"
    return None


@pytest.mark.parametrize("name", list(PAYLOAD_SCENARIOS))
def test_payload_oracle_passes_without_mutants(name: str) -> None:
    """The control: the unmodified adapter's events describe their chunks in every run."""
    assert scenario_findings(name) == []


def test_the_oracle_reads_each_kind_of_wrong_payload() -> None:
    """The oracle on a run's stream with one event changed at a time: each change is found
    (and names the step of the changed event)."""
    from kv_event_oracle import BLOCK_SIZE, payload_findings

    from statecore.bench.scheduler import run_vllm

    events = run_vllm(PAYLOAD_SCENARIOS["events_reset"], "statecore").events
    assert payload_findings(events, block_size=BLOCK_SIZE) == []
    i = next(i for i, e in enumerate(events) if e[1] == "stored" and e[3] is not None)
    j = next(i for i, e in enumerate(events) if e[1] == "removed" and len(e[2]) > 1)
    step, kind, hashes, parent, tokens, bs, medium, group = events[i]
    other = next(
        e for e in events if e[1] == "stored" and parent not in e[2] and e[2][-1] != hashes[-1]
    )
    changed = {
        "tokens of another chunk": (*events[i][:4], other[4], *events[i][5:]),
        "a token": (*events[i][:4], (tokens[0] + 1, *tokens[1:]), *events[i][5:]),
        "another parent": (*events[i][:3], other[2][-1], *events[i][4:]),
        "no parent": (*events[i][:3], None, *events[i][4:]),
        "the placeholder": (step, kind, hashes[-1:], None, (), 0, medium, group),
        "a block size": (*events[i][:5], bs * 2, *events[i][6:]),
        "a hash missing": (*events[i][:2], hashes[1:], *events[i][3:]),
    }
    for what, event in changed.items():
        found = payload_findings(events[:i] + [event] + events[i + 1 :], block_size=BLOCK_SIZE)
        assert any(f.startswith(f"step {step}: ") for f in found), what
    rstep, _, rhashes, rmedium, rgroup = events[j]
    partial = (rstep, "removed", rhashes[1:], rmedium, rgroup)
    found = payload_findings(events[:j] + [partial] + events[j + 1 :], block_size=BLOCK_SIZE)
    assert any("behind" in f for f in found)


def test_the_catalogue_has_the_payload_mutants() -> None:
    """vLLM is importable here, so the family is not empty."""
    assert set(EVENT_PAYLOAD_MUTANTS) >= {
        "payload_lookup_not_recorded",
        "payload_tokens_of_next_chunk",
        "payload_removed_under_a_new_store",
        "payload_dropped_at_removal",
        "payload_dropped_at_reset",
    }


@pytest.mark.parametrize("name", sorted(EVENT_PAYLOAD_MUTANTS))
def test_payload_mutant_is_caught(name: str) -> None:
    """The oracle fails with the mutant applied."""
    with EVENT_PAYLOAD_MUTANTS[name].apply():
        finding = oracle_finding()
    assert finding is not None, f"mutant {name!r} survived the payload oracle"
