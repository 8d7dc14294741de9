"""``statecore tier``: list, inspect and clear the Redis tier's keys on a server.

The tier's keys hold raw bytes (``<prefix>:<fingerprint hex>:<chunk key bytes>``), which
``redis-cli --scan`` cannot print line by line. This command reads them for an operator:

* ``list``: every namespace on the server (prefix and layout fingerprint), with its keys and
  bytes, and how many keys are not the tier's;
* ``inspect PREFIX``: the first keys under ``PREFIX`` in hex, each value's header fields and
  the verdict of its checks (``ok``, ``corrupt``, ``foreign``, ``unknown checksum``), as a
  promotion would check it;
* ``clear PREFIX``: delete every key that starts with ``PREFIX`` (``SCAN`` and ``UNLINK``,
  never ``KEYS`` or ``FLUSHDB``).

Exit status 2 when the URL does not parse, the server does not answer or ``redis`` is not
installed (``pip install "statecore[redis]"``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from statecore.cli import int_range, run_module

__all__ = ["add_arguments", "main", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``statecore tier``."""
    p.add_argument(
        "--redis-url",
        metavar="URL",
        default="redis://127.0.0.1:6379/0",
        help="the server (redis://host:port/db, rediss:// for TLS)",
    )
    p.add_argument("--cluster", action="store_true", help="the server is a cluster node")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="namespaces on the server, with keys and bytes")
    ls.add_argument("--prefix", help="only keys that start with this (default: every key)")
    ins = sub.add_parser("inspect", help="keys under PREFIX: hex key, header, checksum verdict")
    ins.add_argument("prefix", metavar="PREFIX", help="the key prefix (e.g. statecore)")
    ins.add_argument(
        "--limit", type=int_range(1), default=20, metavar="N", help="keys shown at most"
    )
    clr = sub.add_parser("clear", help="delete every key that starts with PREFIX")
    clr.add_argument("prefix", metavar="PREFIX", help="the key prefix (never empty)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``statecore tier`` (usage errors return 2)."""
    return run_module(__name__, argv)


def _client(args: argparse.Namespace) -> Any:
    from statecore.managers.redistier import RedisTierConfig, probe_server

    probe_server(args.redis_url, cluster=args.cluster)
    return RedisTierConfig(url=args.redis_url, cluster=args.cluster, timeout_s=10.0).make_client()


def run(args: argparse.Namespace) -> int:
    """Run one action; 0 on success, 2 when the server cannot be used."""
    from statecore.errors import ConfigError

    try:
        client = _client(args)
    except ConfigError as exc:
        print(f"statecore tier: {exc}", file=sys.stderr)
        return 2
    try:
        if args.action == "list":
            _list(client, (args.prefix or "").encode())
        elif args.action == "inspect":
            _inspect(client, args.prefix.encode(), args.limit)
        else:
            if not args.prefix:
                print("statecore tier: clear needs a non-empty PREFIX", file=sys.stderr)
                return 2
            from statecore.managers.redistier import delete_keys

            n = delete_keys(client, args.prefix.encode())
            print(f"deleted {n} keys that start with {args.prefix!r}")
    finally:
        client.close()
    return 0


_KIND_NAMES = {1: "CRC-32", 2: "XXH3-64"}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _list(client: Any, prefix: bytes) -> None:
    from statecore.managers.redistier import scan_keys, split_key

    groups: dict[tuple[bytes, bytes], list[bytes]] = {}
    other = 0
    for key in scan_keys(client, prefix):
        parts = split_key(key)
        if parts is None:
            other += 1
            continue
        groups.setdefault((parts[0], parts[1]), []).append(key)
    print(f"{'prefix':<40} {'fingerprint':<32} {'keys':>8} {'bytes':>12}")
    for (pre, fp), keys in sorted(groups.items()):
        size = 0
        for i in range(0, len(keys), 1000):
            pipe = client.pipeline(transaction=False)
            for key in keys[i : i + 1000]:
                pipe.strlen(key)
            size += sum(int(n) for n in pipe.execute())
        print(f"{_text(pre):<40} {_text(fp):<32} {len(keys):>8} {size:>12}")
    print(f"{len(groups)} namespaces; {other} keys that are not the tier's")


def _inspect(client: Any, prefix: bytes, limit: int) -> None:
    from statecore.managers.redistier import inspect_value, scan_keys, split_key

    shown = 0
    verdicts: dict[str, int] = {}
    for key in scan_keys(client, prefix):
        if shown >= limit:
            break
        value = client.get(key)
        if value is None:  # deleted or expired since the scan
            continue
        parts = split_key(key)
        chunk = parts[2] if parts is not None else None
        info = inspect_value(value, chunk)
        verdicts[info.verdict] = verdicts.get(info.verdict, 0) + 1
        shown += 1
        head = _text(parts[0]) + ":" + _text(parts[1]) + ":" if parts else ""
        print(f"key      {head}{(chunk if chunk is not None else key).hex()}  ({len(key)} bytes)")
        if info.magic is None:
            print(f"  value  {info.size} bytes, too short for a header  verdict {info.verdict}")
            continue
        print(
            f"  value  {info.size} bytes: magic {info.magic!r} version {info.version} "
            f"checksum kind {info.checksum_kind} ({_KIND_NAMES.get(info.checksum_kind or 0, '?')}) "
            "fingerprint "
            f"{(info.fingerprint or b'').hex()} key length {info.key_length} payload length "
            f"{info.payload_length} checksum {info.checksum:016x}  verdict {info.verdict}"
        )
    print(
        f"{shown} keys inspected: "
        + (", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "none found")
    )
