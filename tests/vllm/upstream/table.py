"""The table of scripts/vllm-upstream-tests.sh: every vLLM test that passes on vLLM and fails
with statecore substituted, with its reason and its class (read from two JUnit XML reports).

    python table.py VLLM_XML STATECORE_XML [LABEL]
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET

TYPED = re.compile(
    r"\b(UnknownKeyError|KeyNotReadyError|PinUnderflowError|WritePendingPinError|"
    r"InvalidKeyError|ManagerError|ManagerStateError|ConfigError|InvalidArgumentError)\b"
)
INTERNAL = re.compile(
    r"has no attribute '(_\w+|t1|t2|b1|b2|target_t1_size|chunks|counts|\w+_in_current_batch)'"
    # (the scheduler mode: names of vLLM's connector scheduler and of its private config)
    r"|a vLLM-internal name|'(GroupView|ConfigView)' object has no attribute"
)
SHAPE = re.compile(r"KeyError: '(vllm:\w+|info)'")
"""vLLM's connector stats payload (statecore's carries statecore's metric names)."""


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of its failure message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = test_id(case)
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (el.get("message") or el.text or "").strip()
                reason = text.splitlines()[0] if text else ""
                break
        out[name] = (outcome, reason)
    return out


def test_id(case: ET.Element) -> str:
    """A JUnit test case's id."""
    return f"{case.get('classname')}::{case.get('name')}"


def shims(path: str) -> dict[str, tuple[str, ...]]:
    """test id -> the vLLM-internal names it went through a shim for (the plugin's
    ``statecore_shims`` property; reads by vLLM's test harness, ``harness:NAME``, left out:
    every scenario of the ``request_runner`` fixture makes them)."""
    out: dict[str, tuple[str, ...]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "statecore_shims":
                names = (prop.get("value") or "").split(",")
                own = tuple(n for n in names if n and not n.startswith("harness:"))
                if own:
                    out[test_id(case)] = own
    return out


def shim_family(name: str) -> str:
    """A shim's family for the counts: the private name before its first field."""
    return name.split(".")[0].split(" ")[0]


def classify(reason: str) -> str:
    """typed error (statecore raises where vLLM asserts), vLLM-internal name, metadata shape
    (vLLM's stats payload), or behaviour."""
    if TYPED.search(reason):
        return "typed error"
    if INTERNAL.search(reason) or "ChunkStatus" in reason:
        return "vLLM-internal name"
    if SHAPE.search(reason):
        return "metadata shape"
    return "behaviour"


def main(argv: list[str]) -> int:
    upstream, ours = outcomes(argv[0]), outcomes(argv[1])
    label = argv[2] if len(argv) > 2 else "statecore"
    passed_up = {t for t, (o, _) in upstream.items() if o == "passed"}
    passed_ours = {t for t, (o, _) in ours.items() if o == "passed"}
    diff = sorted(t for t in passed_up if ours.get(t, ("missing", ""))[0] != "passed")
    used = shims(argv[1])
    print(
        f"tests: {len(upstream)}; passing on vLLM {len(passed_up)}, on {label} {len(passed_ours)}"
    )
    shimmed = sorted(t for t in passed_up & passed_ours if t in used)
    if shimmed:
        print(f"passing on both, with a vLLM-internal name shimmed: {len(shimmed)}")
        families: dict[str, int] = {}
        for t in shimmed:
            for fam in sorted({shim_family(n) for n in used[t]}):
                families[fam] = families.get(fam, 0) + 1
        for fam, n in sorted(families.items()):
            print(f"  through {fam}: {n}")
    print(f"passing on vLLM, failing on {label}: {len(diff)}")
    counts: dict[str, int] = {}
    rows = []
    for t in diff:
        reason = ours.get(t, ("missing", "not run"))[1]
        cls = classify(reason)
        counts[cls] = counts.get(cls, 0) + 1
        via = ",".join(sorted({shim_family(n) for n in used.get(t, ())}))
        rows.append((t.replace("tests.v1.", ""), cls, (f"[{via}] " if via else "") + reason[:110]))
    for cls, n in sorted(counts.items()):
        print(f"  {cls}: {n}")
    if rows:
        print(f"\n{'test':<90} {'class':<20} [shims gone through] reason")
        for t, cls, reason in rows:
            print(f"{t:<90} {cls:<20} {reason}")
    if shimmed:
        print(f"\n{'passing with a shim':<90} shims")
        for t in shimmed:
            print(f"{t.replace('tests.v1.', ''):<90} {', '.join(used[t])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
