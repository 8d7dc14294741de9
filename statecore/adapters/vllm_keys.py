"""Every ``kv_connector_extra_config`` key of vLLM 0.33's offloading connector, as statecore
treats it: implemented with vLLM's meaning, or rejected at start-up with an error that names
the key and says why. No key is silently ignored, and unknown keys are rejected.

This module imports nothing from vLLM, so the table is checked by the default test command and
rendered into the documentation (``docs/reference/vllm-config.md``, by ``statecore docs``).

Theory of operation: :data:`EXTRA_KEYS` (top-level keys) and :data:`FS_TIER_KEYS` (the keys of
one ``secondary_tiers`` entry of type ``"fs"``) map each key to an :class:`ExtraKey`: vLLM's
meaning, statecore's status, and for values statecore does not implement a ``check`` that
returns the reason (or None when the value is fine). :func:`validate_extra_config` walks a
user's config against the tables before anything is built and raises
:class:`~statecore.errors.ConfigError` for the first problem; it returns the validated view
(:class:`ExtraConfig`) that the adapter builds from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from statecore.errors import ConfigError

__all__ = [
    "EXTRA_KEYS",
    "FS_TIER_KEYS",
    "REFUSED_EXAMPLES",
    "SPEC_NAMES",
    "STATECORE_TIER_KINDS",
    "ExtraConfig",
    "ExtraKey",
    "refusal_message",
    "render_table_page",
    "validate_extra_config",
]

SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
"""The ``spec_name`` values statecore builds (vLLM's two registered specs)."""

Check = Callable[[Any, Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class ExtraKey:
    """One extra-config key.

    Attributes:
        name: the key.
        vllm: what the key means in vLLM 0.33.
        status: ``"implemented"`` (with vLLM's meaning, for every value ``check`` accepts),
            ``"rejected"`` (any value is an error) or ``"statecore"`` (a statecore extension
            vLLM does not have).
        statecore: how statecore implements it, or why it rejects it.
        check: ``check(value, whole_config)`` returns why a value is refused, or None.
    """

    name: str
    vllm: str
    status: str
    statecore: str
    check: Check | None = field(default=None, compare=False)

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        """Why ``value`` is refused (None when accepted)."""
        if self.status == "rejected":
            return self.statecore
        return self.check(value, config) if self.check is not None else None


def _int_at_least(lo: int) -> Check:
    def check(value: Any, config: Mapping[str, Any]) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | str):
            return f"must be an integer >= {lo}, got {value!r}"
        try:
            n = int(value)
        except ValueError:
            return f"must be an integer >= {lo}, got {value!r}"
        return None if n >= lo else f"must be >= {lo}, got {n}"

    return check


def _number_positive(value: Any, config: Mapping[str, Any]) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number > 0, got {value!r}"
    return None if value > 0 else f"must be > 0, got {value!r}"


def _is_bool(value: Any, config: Mapping[str, Any]) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _spec_name(value: Any, config: Mapping[str, Any]) -> str | None:
    if value in SPEC_NAMES:
        return None
    if not isinstance(value, str) or not value:
        return f"must be a spec class name, got {value!r}"
    if "spec_module_path" in config:
        return None
    return (
        f"{value!r} is not a spec statecore builds; use one of {', '.join(SPEC_NAMES)}, or "
        "name an out-of-tree OffloadingSpec's module with spec_module_path"
    )


def _spec_module_path(value: Any, config: Mapping[str, Any]) -> str | None:
    if not isinstance(value, str) or not value:
        return f"must be a module path, got {value!r}"
    if config.get("spec_name", SPEC_NAMES[0]) in SPEC_NAMES:
        return (
            "is read only with an out-of-tree spec_name (vLLM ignores it for its registered "
            "specs): name the spec class in spec_name"
        )
    if config.get("secondary_tiers"):
        return "an out-of-tree spec builds its own tiers: remove secondary_tiers"
    return None


def _store_threshold(value: Any, config: Mapping[str, Any]) -> str | None:
    bad = _int_at_least(0)(value, config)
    if bad is not None:
        return bad
    if int(value) >= 2 and config.get("spec_name") == "TieringOffloadingSpec":
        return "store_threshold >= 2 is not supported with TieringOffloadingSpec (as in vLLM)"
    return None


def _eviction_policy(value: Any, config: Mapping[str, Any]) -> str | None:
    if not isinstance(value, str) or not value:
        return f"must be a policy name, got {value!r}"
    if "cache_policy_module_path" in config:
        return None if ":" not in value else "give a class name with cache_policy_module_path"
    if value in ("lru", "arc") or ":" in value:
        return None
    return (
        f"{value!r} is not 'lru', 'arc' or 'package.module:Class' (or a class name with "
        "cache_policy_module_path); vLLM's CachePolicyFactory registry is not consulted"
    )


def _module_path(value: Any, config: Mapping[str, Any]) -> str | None:
    if not isinstance(value, str) or not value:
        return f"must be a module path, got {value!r}"
    if "eviction_policy" not in config:
        return "needs eviction_policy (the class name to load from this module)"
    return None


STATECORE_TIER_KINDS = ("file", "redis")
"""statecore's own tier specs (``{"kind": ...}``, :mod:`statecore.managers.tierconfig`)."""


def _secondary_tiers(value: Any, config: Mapping[str, Any]) -> str | None:
    if not isinstance(value, list):
        return "must be a list of tier configurations (as in vLLM)"
    for i, tier in enumerate(value):
        if not isinstance(tier, Mapping):
            return f"entry {i} must be a dict, got {type(tier).__name__}"
        if "type" not in tier and tier.get("kind") in STATECORE_TIER_KINDS:
            continue  # statecore's own spec: its options are checked when the tier is built
        if config.get("spec_name") != "TieringOffloadingSpec":
            return (
                f"entry {i}: vLLM tiers need spec_name 'TieringOffloadingSpec' (vLLM ignores "
                "them without); statecore's own entries use 'kind' ('file' or 'redis')"
            )
        kind = tier.get("type")
        if kind != "fs":
            return (
                f"entry {i}: tier type {kind!r} is not implemented by statecore (only 'fs', "
                "a file-system tier)"
            )
        for key, val in tier.items():
            spec = FS_TIER_KEYS.get(key)
            if spec is None:
                return f"entry {i}: unknown fs tier key {key!r} (known: {', '.join(FS_TIER_KEYS)})"
            problem = spec.problem(val, tier)
            if problem is not None:
                return f"entry {i}: key {key!r}: {problem}"
        if "root_dir" not in tier:
            return f"entry {i}: an fs tier needs root_dir"
    return None


def _poll_interval(value: Any, config: Mapping[str, Any]) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number, got {value!r}"
    if value <= 0:
        return None
    return (
        f"{value} > 0 asks for a background tier-poll thread, which statecore does not run: its "
        "tiers are polled once per engine step, which is vLLM's meaning of a value <= 0"
    )


def _false_only(what: str) -> Check:
    def check(value: Any, config: Mapping[str, Any]) -> str | None:
        bad = _is_bool(value, config)
        if bad is not None:
            return bad
        return None if value is False else what

    return check


def _zero_only(what: str) -> Check:
    def check(value: Any, config: Mapping[str, Any]) -> str | None:
        bad = _int_at_least(0)(value, config)
        if bad is not None:
            return bad
        return None if int(value) == 0 else what

    return check


def _one_of(*allowed: str) -> Check:
    def check(value: Any, config: Mapping[str, Any]) -> str | None:
        if value in allowed:
            return None
        return f"must be one of {', '.join(map(repr, allowed))}, got {value!r}"

    return check


def _root_dir(value: Any, config: Mapping[str, Any]) -> str | None:
    return None if isinstance(value, str) and value else f"must be a directory, got {value!r}"


def _fs_type(value: Any, config: Mapping[str, Any]) -> str | None:
    return None if value == "fs" else f"only 'fs' is implemented, got {value!r}"


_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey(
        "spec_name",
        "The OffloadingSpec to build: CPUOffloadingSpec (default) or TieringOffloadingSpec, "
        "or an out-of-tree class name with spec_module_path.",
        "implemented",
        "CPUOffloadingSpec: statecore's CPU tier; TieringOffloadingSpec: statecore's "
        "TieringOffloadingManager over the CPU tier, with the secondary_tiers below; another "
        "name with spec_module_path: that out-of-tree spec's manager behind statecore's "
        "scheduler (statecore.adapters.vllm_spec). Any other name is refused.",
        _spec_name,
    ),
    ExtraKey(
        "spec_module_path",
        "Module to import an out-of-tree OffloadingSpec from.",
        "implemented",
        "The same (vLLM's OffloadingSpecFactory loads it); the spec's manager runs behind "
        "statecore's scheduler and must place chunks in CPU slots (vLLM's CPULoadStoreSpec), "
        "which statecore's workers copy; the spec's own workers are not used. The spec's "
        "own extra-config keys are passed to it unchecked.",
        _spec_module_path,
    ),
    ExtraKey(
        "cpu_bytes_to_use",
        "CPU tier capacity in bytes (divided by the page-aligned bytes of one chunk over every "
        "rank).",
        "implemented",
        "The same arithmetic, so one config gives both connectors the same capacity.",
        _int_at_least(1),
    ),
    ExtraKey(
        "block_size",
        "Tokens per offloaded chunk (a multiple of the GPU block size).",
        "implemented",
        "The same; not together with blocks_per_chunk.",
        _int_at_least(1),
    ),
    ExtraKey(
        "blocks_per_chunk",
        "GPU blocks per offloaded chunk.",
        "implemented",
        "The same; not together with block_size.",
        _int_at_least(1),
    ),
    ExtraKey(
        "eviction_policy",
        "The CPU tier's eviction policy: 'lru', 'arc', a name registered with vLLM's "
        "CachePolicyFactory, or a class name with cache_policy_module_path.",
        "implemented",
        "'lru', 'arc', 'package.module:Class', or a class name with cache_policy_module_path; "
        "the class must implement statecore's CachePolicy (a RequestCachePolicy also sees "
        "request boundaries). 'lru' and 'arc' have vLLM 0.33's request-aware semantics "
        "(statecore's request-lru and request-arc) unless policy_semantics is 'access'.",
        _eviction_policy,
    ),
    ExtraKey(
        "cache_policy_module_path",
        "Module to import the eviction_policy class from.",
        "implemented",
        "The same (the class must implement statecore's CachePolicy).",
        _module_path,
    ),
    ExtraKey(
        "store_threshold",
        "With 2 or more, a new key is stored only once it has been offered for storing that "
        "many times (store offers are counted, not lookups; not supported with "
        "TieringOffloadingSpec).",
        "implemented",
        "The same (offers counted), refused with TieringOffloadingSpec as in vLLM; with "
        "policy_semantics 'access', lookups are counted instead.",
        _store_threshold,
    ),
    ExtraKey(
        "max_tracker_size",
        "Keys the store_threshold filter remembers.",
        "implemented",
        "The same.",
        _int_at_least(1),
    ),
    ExtraKey(
        "offload_prompt_only",
        "Store only prompt tokens (default true).",
        "implemented",
        "The same.",
        _is_bool,
    ),
    ExtraKey(
        "secondary_tiers",
        "TieringOffloadingSpec's secondary tiers, a list of dicts with a 'type' ('fs', 'p2p', "
        "'obj', 'kvcr', 'example', or an out-of-tree class with 'module_path') and the tier's "
        "parameters.",
        "implemented",
        "Type 'fs' only: statecore's FileTier (see the fs tier keys); every other type, and "
        "vLLM tiers without TieringOffloadingSpec, are refused. statecore's own entries "
        "({'kind': 'file' | 'redis', ...}, statecore.managers.tierconfig) are accepted too.",
        _secondary_tiers,
    ),
    ExtraKey(
        "tier_poll_interval_s",
        "Pause between polls of a background tier-poll thread; zero or negative disables the "
        "thread and polls once per engine step.",
        "implemented",
        "Values <= 0 (statecore polls its tiers once per engine step); a positive value is "
        "refused.",
        _poll_interval,
    ),
    ExtraKey(
        "backpressure",
        "Default back-pressure detector for secondary tiers (drops stores to a slow tier).",
        "rejected",
        "back-pressure detection for secondary tiers is not implemented by statecore",
    ),
    ExtraKey(
        "canonical_layout",
        "Offload topology-free canonical KV pages (default false).",
        "implemented",
        "false only: statecore's transfer adapter copies the engine's own layout; true is refused.",
        _false_only(
            "canonical (topology-free) KV pages are not implemented by statecore's transfer "
            "adapter; remove canonical_layout or set it to false"
        ),
    ),
    ExtraKey(
        "sync_load_budget_bytes",
        "Per-step bytes of small loads done synchronously within the step (0 disables).",
        "implemented",
        "0 only: statecore loads asynchronously; a positive budget is refused.",
        _zero_only(
            "synchronous in-step loads are not implemented by statecore (it loads "
            "asynchronously); set sync_load_budget_bytes to 0"
        ),
    ),
    ExtraKey(
        "self_describing_kv_events",
        "KV events carry each chunk's block hashes, parent hash, token ids and block size "
        "(default false: one placeholder hash per chunk).",
        "implemented",
        "The same payloads, both ways.",
        _is_bool,
    ),
    ExtraKey(
        "policy_semantics",
        "(statecore only)",
        "statecore",
        "How the CPU tier's policies count uses: 'vllm' (the default: vLLM 0.33's, a "
        "request-ranked, position-ordered LRU; ARC counting reuse and adapting its target once "
        "per request; store_threshold counting store offers) or 'access' (statecore's former "
        "semantics: recency and reuse per access, store_threshold counting lookups).",
        _one_of("vllm", "access"),
    ),
    ExtraKey(
        "num_cpu_chunks",
        "(statecore only)",
        "statecore",
        "CPU tier capacity in chunks, instead of cpu_bytes_to_use.",
        _int_at_least(1),
    ),
    ExtraKey(
        "max_recompute_pending_tokens",
        "(statecore only)",
        "statecore",
        "A pending run of at most this many tokens is recomputed instead of waited for.",
        _int_at_least(0),
    ),
    ExtraKey(
        "stall_timeout_s",
        "(statecore only)",
        "statecore",
        "A job with no full quorum after this long is failed and flushed.",
        _number_positive,
    ),
    ExtraKey(
        "stall_check_interval_s",
        "(statecore only)",
        "statecore",
        "How often the stall check runs.",
        _number_positive,
    ),
)

EXTRA_KEYS: dict[str, ExtraKey] = {k.name: k for k in _KEYS}
"""Every top-level key statecore knows, by name."""

_FS_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey("type", "The tier type.", "implemented", "'fs' only.", _fs_type),
    ExtraKey(
        "module_path",
        "Module to import an out-of-tree tier class from.",
        "rejected",
        "out-of-tree vLLM tier classes are not driven by statecore",
    ),
    ExtraKey(
        "root_dir",
        "Directory of the chunk files.",
        "implemented",
        "The FileTier's directory (statecore's own file format: one checksummed file per "
        "chunk; not interchangeable with vLLM's files).",
        _root_dir,
    ),
    ExtraKey(
        "n_read_threads",
        "Read-priority I/O threads.",
        "implemented",
        "Added to n_write_threads: the FileTier's I/O thread pool size.",
        _int_at_least(1),
    ),
    ExtraKey(
        "n_write_threads",
        "Write-priority I/O threads.",
        "implemented",
        "Added to n_read_threads: the FileTier's I/O thread pool size.",
        _int_at_least(1),
    ),
    ExtraKey(
        "enable_kv_events",
        "Emit KV events for chunks stored to this tier (with kv_events_config on).",
        "implemented",
        "The same (medium STORAGE).",
        _is_bool,
    ),
    ExtraKey(
        "locality",
        "LOCAL or REMOTE, as published in the tier's KV events.",
        "rejected",
        "tier locality in KV events is not implemented by statecore",
    ),
    ExtraKey(
        "backpressure",
        "Back-pressure detector of this tier.",
        "rejected",
        "back-pressure detection for secondary tiers is not implemented by statecore",
    ),
    ExtraKey(
        "max_bytes",
        "(statecore only)",
        "statecore",
        "Size limit: least recently used files are deleted beyond it.",
        _int_at_least(0),
    ),
    ExtraKey(
        "fsync",
        "(statecore only)",
        "statecore",
        "fsync each chunk file before it becomes visible.",
        _is_bool,
    ),
)

FS_TIER_KEYS: dict[str, ExtraKey] = {k.name: k for k in _FS_KEYS}
"""Every key of one ``secondary_tiers`` entry of type ``"fs"``, by name."""


@dataclass(frozen=True)
class ExtraConfig:
    """A validated extra config (only what statecore builds from)."""

    raw: Mapping[str, Any]
    tiering: bool
    tier_specs: tuple[Mapping[str, Any], ...]
    """The secondary tiers as statecore tier specs (``{"kind": ...}``)."""
    storage_events: bool
    """Some file-system tier asked for KV events (vLLM's ``enable_kv_events``)."""
    spec_module_path: str | None
    """An out-of-tree spec's module (its manager runs behind statecore's scheduler)."""
    eviction_policy: str
    """The CPU tier's policy name for :class:`~statecore.managers.cpu.CPUOffloadingManager`
    (``lru`` and ``arc`` already mapped to ``request-lru`` / ``request-arc`` under the
    ``vllm`` policy semantics)."""
    store_threshold: int
    max_tracker_size: int
    self_describing_kv_events: bool
    reuse_counts: str = "offers"
    """What ``store_threshold`` counts: ``offers`` (vLLM's) or ``lookups``."""


def validate_extra_config(extra: Mapping[str, Any] | None) -> ExtraConfig:
    """Check every key of ``extra`` against the tables; raise on the first problem.

    Raises :class:`~statecore.errors.ConfigError` naming the key and why: an unknown key, a
    key statecore rejects, or a value it does not implement.
    """
    cfg: Mapping[str, Any] = dict(extra or {})
    out_of_tree = "spec_module_path" in cfg
    for key in sorted(cfg):
        spec = EXTRA_KEYS.get(key)
        if spec is None and out_of_tree:
            continue  # (the out-of-tree spec's own key: vLLM hands the config to the spec)
        if spec is None:
            raise ConfigError(
                f"statecore connector: unknown kv_connector_extra_config key {key!r} (see "
                "docs/reference/vllm-config.md for every key vLLM 0.33 and statecore accept)"
            )
        problem = spec.problem(cfg[key], cfg)
        if problem is not None:
            raise ConfigError(f"statecore connector: kv_connector_extra_config {key!r}: {problem}")
    tiers: list[Mapping[str, Any]] = []
    storage_events = False
    for i, tier in enumerate(cfg.get("secondary_tiers", [])):
        if "type" not in tier:
            tiers.append(dict(tier))
            continue
        threads = int(tier.get("n_read_threads", 2)) + int(tier.get("n_write_threads", 2))
        file_spec: dict[str, Any] = {
            "kind": "file",
            "directory": str(tier["root_dir"]),
            "workers": threads,
            "fsync": bool(tier.get("fsync", False)),
            "name": f"fs{i}",
        }
        if tier.get("max_bytes") is not None:
            file_spec["max_bytes"] = int(tier["max_bytes"])
        storage_events |= bool(tier.get("enable_kv_events", False))
        tiers.append(file_spec)
    policy = str(cfg.get("eviction_policy", "lru"))
    vllm_semantics = cfg.get("policy_semantics", "vllm") == "vllm"
    if "cache_policy_module_path" in cfg:
        policy = f"{cfg['cache_policy_module_path']}:{policy}"
    elif vllm_semantics and policy in ("lru", "arc"):
        policy = f"request-{policy}"
    return ExtraConfig(
        raw=cfg,
        tiering=cfg.get("spec_name") == "TieringOffloadingSpec" or bool(tiers),
        tier_specs=tuple(tiers),
        storage_events=storage_events,
        spec_module_path=(str(cfg["spec_module_path"]) if "spec_module_path" in cfg else None),
        eviction_policy=policy,
        store_threshold=int(cfg.get("store_threshold", 0)),
        max_tracker_size=int(cfg.get("max_tracker_size", 64_000)),
        self_describing_kv_events=bool(cfg.get("self_describing_kv_events", False)),
        reuse_counts="offers" if vllm_semantics else "lookups",
    )


_TIERING: dict[str, Any] = {"spec_name": "TieringOffloadingSpec"}
_FS: dict[str, Any] = {"type": "fs", "root_dir": "/mnt/kv"}

REFUSED_EXAMPLES: tuple[tuple[str, Mapping[str, Any]], ...] = (
    ("spec_name", {"spec_name": "MyOffloadingSpec"}),
    ("spec_module_path", {"spec_module_path": "my_package.my_spec"}),
    ("eviction_policy", {"eviction_policy": "my_registered_policy"}),
    ("store_threshold", {**_TIERING, "store_threshold": 2}),
    ("secondary_tiers", {"secondary_tiers": [_FS]}),
    ("secondary_tiers", {**_TIERING, "secondary_tiers": [{"type": "p2p"}]}),
    ("secondary_tiers", {**_TIERING, "secondary_tiers": [{**_FS, "locality": "LOCAL"}]}),
    ("secondary_tiers", {**_TIERING, "secondary_tiers": [{**_FS, "backpressure": {}}]}),
    ("secondary_tiers", {**_TIERING, "secondary_tiers": [{**_FS, "module_path": "pkg"}]}),
    ("tier_poll_interval_s", {**_TIERING, "tier_poll_interval_s": 0.01}),
    ("backpressure", {**_TIERING, "backpressure": {"backpressure_cls": "EMA"}}),
    ("canonical_layout", {"canonical_layout": True}),
    ("sync_load_budget_bytes", {"sync_load_budget_bytes": 1 << 20}),
    ("(unknown)", {"cpu_bytes_to_use_gb": 64}),
)
"""A refused value of each key that refuses some (or all) values, as a whole extra config;
the page shows the error each one gives."""


def refusal_message(config: Mapping[str, Any]) -> str:
    """The :class:`~statecore.errors.ConfigError` message ``config`` gets at start-up."""
    try:
        validate_extra_config(config)
    except ConfigError as exc:
        return str(exc)
    raise ValueError(f"{config!r} is accepted")


def _key_table(title: str, specs: Iterable[ExtraKey]) -> list[str]:
    """One section of the page: a heading and a row per key."""
    head = [
        "## " + title,
        "",
        "| key | vLLM 0.33 meaning | statecore | how, or the error's reason |",
    ]
    return [*head, "| --- | --- | --- | --- |", *map(_row, specs), ""]


def render_table_page() -> str:
    """The documentation page: both tables, with each rejection's message."""
    out = [
        "# vLLM extra-config keys",
        "",
        "<!-- generated by `statecore docs` from statecore.adapters.vllm_keys: do not edit -->",
        "",
        "Every `kv_connector_extra_config` key that vLLM 0.33's offloading connector reads, "
        "and statecore's own, as `StatecoreOffloadingConnector` treats them. A key is "
        "*implemented* with vLLM's meaning (for the values named), *rejected* at start-up "
        "with a `ConfigError` that names the key and gives the reason shown, or a *statecore* "
        "extension. Any other key is rejected as unknown. Values outside what is implemented "
        "are rejected the same way.",
        "",
    ]
    out += _key_table("Top-level keys", _KEYS)
    out += _key_table('Keys of a `secondary_tiers` entry of type `"fs"`', _FS_KEYS)
    out += [
        "## Refused values and their errors",
        "",
        "The start-up error for a refused value of each key (the connector raises it in every "
        "process, before anything is built):",
        "",
        "| key | extra config | error |",
        "| --- | --- | --- |",
    ]
    for key, example in REFUSED_EXAMPLES:
        shown = repr(dict(example)).replace("|", "\\|")
        msg = refusal_message(example).replace("|", "\\|")
        out.append(f"| `{key}` | `{shown}` | {msg} |")
    out.append("")
    return "\n".join(out)


def _row(spec: ExtraKey) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    return f"| `{spec.name}` | {cell(spec.vllm)} | {spec.status} | {cell(spec.statecore)} |"
