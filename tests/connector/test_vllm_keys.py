"""The vLLM extra-config table: every key vLLM 0.33 reads has a meaning or an error, unknown
keys are errors, and the errors name the key and say why (no vLLM needed)."""

from __future__ import annotations

from typing import Any

import pytest

from statecore import ConfigError
from statecore.adapters.vllm_keys import (
    EXTRA_KEYS,
    FS_TIER_KEYS,
    render_table_page,
    validate_extra_config,
)

# Every kv_connector_extra_config key vLLM 0.33.0's offloading connector, its CPU and tiering
# specs read (tests/vllm checks this list against vLLM's installed source).
VLLM_033_KEYS = {
    "spec_name",
    "spec_module_path",
    "cpu_bytes_to_use",
    "block_size",
    "blocks_per_chunk",
    "eviction_policy",
    "cache_policy_module_path",
    "store_threshold",
    "max_tracker_size",
    "offload_prompt_only",
    "secondary_tiers",
    "tier_poll_interval_s",
    "backpressure",
    "canonical_layout",
    "sync_load_budget_bytes",
    "self_describing_kv_events",
}
VLLM_033_FS_KEYS = {
    "type",
    "module_path",
    "root_dir",
    "n_read_threads",
    "n_write_threads",
    "enable_kv_events",
    "locality",
    "backpressure",
}

TIERING = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}


def fs(**kw: Any) -> dict[str, Any]:
    return {"type": "fs", "root_dir": "/tmp/x", **kw}


def refusal(extra: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        validate_extra_config(extra)
    return str(info.value)


def test_every_vllm_key_is_in_the_table() -> None:
    assert set(EXTRA_KEYS) >= VLLM_033_KEYS
    assert set(FS_TIER_KEYS) >= VLLM_033_FS_KEYS
    for spec in [*EXTRA_KEYS.values(), *FS_TIER_KEYS.values()]:
        assert spec.status in ("implemented", "rejected", "statecore")
        assert (spec.status == "statecore") == (spec.name not in VLLM_033_KEYS | VLLM_033_FS_KEYS)


def test_the_page_lists_every_key_with_its_status() -> None:
    page = render_table_page()
    for spec in [*EXTRA_KEYS.values(), *FS_TIER_KEYS.values()]:
        assert f"| `{spec.name}` |" in page
    for spec in EXTRA_KEYS.values():
        if spec.status == "rejected":
            assert spec.statecore in page


def test_unknown_key_is_refused_by_name() -> None:
    msg = refusal({"num_cpu_chunk": 10})
    assert "'num_cpu_chunk'" in msg and "unknown" in msg


@pytest.mark.parametrize(
    ("extra", "key", "why"),
    [
        ({"spec_name": "MyOffloadingSpec"}, "spec_name", "not a spec statecore builds"),
        ({"spec_module_path": "pkg.mod"}, "spec_module_path", "out-of-tree"),
        ({"backpressure": {}}, "backpressure", "not implemented"),
        ({"canonical_layout": True}, "canonical_layout", "not implemented"),
        ({"sync_load_budget_bytes": 4096}, "sync_load_budget_bytes", "asynchronously"),
        ({**TIERING, "tier_poll_interval_s": 0.5}, "tier_poll_interval_s", "once per engine"),
        ({"secondary_tiers": [fs()]}, "secondary_tiers", "TieringOffloadingSpec"),
        ({**TIERING, "secondary_tiers": [{"type": "p2p"}]}, "secondary_tiers", "'p2p'"),
        ({**TIERING, "secondary_tiers": [fs(locality="LOCAL")]}, "secondary_tiers", "locality"),
        ({**TIERING, "secondary_tiers": [fs(root=1)]}, "secondary_tiers", "unknown fs tier key"),
        ({**TIERING, "secondary_tiers": [{"type": "fs"}]}, "secondary_tiers", "root_dir"),
        ({**TIERING, "store_threshold": 2}, "store_threshold", "TieringOffloadingSpec"),
        ({"eviction_policy": "fifo"}, "eviction_policy", "'fifo'"),
        ({"cache_policy_module_path": "pkg"}, "cache_policy_module_path", "eviction_policy"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk", ">= 1"),
        ({"offload_prompt_only": "yes"}, "offload_prompt_only", "true or false"),
    ],
)
def test_refusals_name_the_key_and_why(extra: dict[str, Any], key: str, why: str) -> None:
    msg = refusal(extra)
    assert f"'{key}'" in msg and why in msg, msg


def test_implemented_values_build_the_config() -> None:
    cfg = validate_extra_config(
        {
            **TIERING,
            "secondary_tiers": [fs(n_read_threads=3, n_write_threads=1, max_bytes=1 << 30)],
            "tier_poll_interval_s": 0,
            "canonical_layout": False,
            "sync_load_budget_bytes": 0,
            "self_describing_kv_events": True,
            "eviction_policy": "MyPolicy",
            "cache_policy_module_path": "pkg.policies",
        }
    )
    assert cfg.tiering and cfg.self_describing_kv_events
    (tier,) = cfg.tier_specs
    assert tier == {
        "kind": "file",
        "directory": "/tmp/x",
        "workers": 4,
        "fsync": False,
        "name": "fs0",
        "max_bytes": 1 << 30,
    }
    assert cfg.eviction_policy == "pkg.policies:MyPolicy"
    plain = validate_extra_config({"num_cpu_chunks": 8})
    assert not plain.tiering and not plain.tier_specs
    # vLLM 0.33's semantics by default; statecore's former ones by name
    assert plain.eviction_policy == "request-lru" and plain.reuse_counts == "offers"
    access = validate_extra_config({"eviction_policy": "arc", "policy_semantics": "access"})
    assert access.eviction_policy == "arc" and access.reuse_counts == "lookups"
    assert validate_extra_config({"eviction_policy": "arc"}).eviction_policy == "request-arc"
    with pytest.raises(ConfigError, match="policy_semantics"):
        validate_extra_config({"policy_semantics": "lru"})
    oot = validate_extra_config(
        {"spec_name": "MySpec", "spec_module_path": "my_pkg.spec", "my_own_key": 1}
    )
    assert oot.spec_module_path == "my_pkg.spec" and not oot.tiering
    with pytest.raises(ConfigError, match="spec_module_path"):
        validate_extra_config({"spec_name": "CPUOffloadingSpec", "spec_module_path": "m"})
    own = validate_extra_config({"secondary_tiers": [{"kind": "redis", "url": "redis://h/0"}]})
    assert own.tiering and own.tier_specs == ({"kind": "redis", "url": "redis://h/0"},)


def test_the_page_shows_the_error_of_every_refusable_key() -> None:
    from statecore.adapters.vllm_keys import REFUSED_EXAMPLES, refusal_message

    page = render_table_page()
    shown = {key for key, _ in REFUSED_EXAMPLES}
    for spec in EXTRA_KEYS.values():
        if spec.status == "rejected" or spec.name in ("tier_poll_interval_s", "canonical_layout"):
            assert spec.name in shown, spec.name
    for key, example in REFUSED_EXAMPLES:
        msg = refusal_message(example)
        assert key == "(unknown)" or f"'{key}'" in msg
        assert msg.replace("|", "\\|") in page
