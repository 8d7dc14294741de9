"""Secondary tiers from plain configuration (a dict per tier, e.g. from JSON or vLLM's extra
config), so a deployment chooses its tiers without code.

A tier spec is a mapping with ``kind`` and that kind's options:

* ``{"kind": "file", "directory": ..., "max_bytes": ..., "workers": ..., "fsync": ...}``:
  a :class:`~statecore.managers.filetier.FileTier`;
* ``{"kind": "redis", "url": ..., "cluster": ..., "prefix": ..., "ttl_s": ...,
  "timeout_s": ..., "workers": ..., "max_batch_bytes": ..., "lookup_ttl_steps": ...,
  "max_known_keys": ...}``: a :class:`~statecore.managers.redistier.RedisTier` (the
  layout comes from the caller, which knows the model and the KV cache).

Both take ``name`` (statistics prefix). An unknown kind or option is a
:class:`~statecore.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from statecore.errors import ConfigError
from statecore.managers.tiers import SecondaryTier
from statecore.pool import CPUPool

__all__ = ["TIER_KINDS", "build_tier"]

TIER_KINDS = ("file", "redis")
"""The ``kind`` values :func:`build_tier` accepts."""

_FILE_OPTIONS = ("directory", "max_bytes", "workers", "fsync", "name")


def build_tier(spec: Mapping[str, Any], pool: CPUPool, layout: Any = None) -> SecondaryTier:
    """The secondary tier ``spec`` describes, over ``pool``.

    Args:
        spec: the tier's kind and options (module docstring).
        pool: the shared CPU pool the tier copies to and from.
        layout: the engine's :class:`~statecore.managers.redistier.TierLayout` (redis tiers
            namespace their keys with it; file tiers seed their checksums with its fingerprint).
    """
    opts = dict(spec)
    kind = opts.pop("kind", None)
    if kind == "file":
        unknown = sorted(set(opts) - set(_FILE_OPTIONS))
        if unknown:
            raise ConfigError(f"file tier: unknown option(s) {unknown}; known: {_FILE_OPTIONS}")
        if "directory" not in opts:
            raise ConfigError("file tier: 'directory' is required")
        from statecore.managers.filetier import FileTier

        fingerprint = getattr(layout, "fingerprint", None)
        if fingerprint is not None:  # files of another engine layout are refused
            opts["layout"] = bytes(fingerprint(pool.row_bytes)).hex()
        return FileTier(pool=pool, **opts)
    if kind == "redis":
        from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout

        name = str(opts.pop("name", "redis"))
        known = {f.name for f in dataclasses.fields(RedisTierConfig)} - {"layout"}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"redis tier: unknown option(s) {unknown}; known: {sorted(known)}")
        if layout is not None and not isinstance(layout, TierLayout):
            raise ConfigError(f"redis tier: layout must be a TierLayout, got {layout!r}")
        if layout is not None:
            opts["layout"] = layout
        return RedisTier(RedisTierConfig(**opts), pool, name=name)
    raise ConfigError(f"secondary tier: unknown kind {kind!r}; known kinds: {TIER_KINDS}")
