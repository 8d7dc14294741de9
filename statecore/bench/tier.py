"""``statecore bench tier``: RedisTier throughput next to plain pipelined SET/GET of the same bytes.

For each chunk size (256 KiB, 1 MiB, 2 MiB by default) it fills a CPU pool with random chunks
(two regions, as a K and a V tensor would give) and measures, in the same run, with the same
redis-py client and the same server:

* ``baseline store``: one pipeline of ``SET`` with the chunks' bytes already joined;
* ``tier store``: :meth:`RedisTier.submit_store` of the same slots (header, checksum, the one
  join copy, the pipeline), run inline and collected;
* ``baseline load``: one pipeline of ``GET`` of those keys;
* ``tier load`` (promotion): :meth:`RedisTier.submit_load` into pool slots (GET, header and
  checksum verification, copy into the rows), checked byte for byte afterwards.

Figures are GB/s of chunk payload, best of ``--repeat`` passes (the two paths alternate pass by
pass, so both see the same load on the machine); ``client CPU ratio`` is the baseline's CPU
seconds in this process over the tier's (best pass each), which a loaded machine disturbs less
than wall time; ``ratio`` is tier / baseline
(the goal is >= 0.8). Without ``--url`` a throw-away ``redis-server`` is started on loopback
(see :mod:`statecore.services.redisserver`). This is a command, not a test: nothing asserts timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

from statecore.cli import int_range, run_module
from statecore.keys import make_offload_key
from statecore.managers.filetier import InlineExecutor
from statecore.managers.redistier import RedisTier, RedisTierConfig, TierLayout
from statecore.pool import CPUPool

__all__ = ["add_arguments", "main", "measure", "run"]


def _timed(fn: Callable[[int], None], rep: int) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (all its threads) of one pass."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn(rep)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(
    url: str, chunk_bytes: int, total_bytes: int, repeat: int, cluster: bool
) -> dict[str, float]:
    """Seconds per pass of each of the four paths for one chunk size, and a byte check."""
    n = max(1, total_bytes // chunk_bytes)
    half = chunk_bytes // 2
    pool = CPUPool(n, [half, chunk_bytes - half])
    for r in range(pool.num_regions):
        pool.region(r)[:] = os.urandom(len(pool.region(r)))
    layout = TierLayout("bench", "uint8", (chunk_bytes,), 1)
    cfg = RedisTierConfig(url=url, layout=layout, cluster=cluster, prefix="bench", timeout_s=30.0)
    client = cfg.make_client()
    tier = RedisTier(cfg, pool, executor=InlineExecutor(), client=client)
    slots = list(range(n))
    payloads = [pool.read_slot(s) for s in slots]

    tier_keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(n)]

    raw_keys = [b"bench:raw:%d" % i for i in range(n)]
    job = iter(range(1 << 30))

    def base_store(rep: int) -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in zip(raw_keys, payloads, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def base_load(rep: int) -> None:
        pipe = client.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        got = pipe.execute()
        if len(got) != n or any(g is None for g in got):
            raise RuntimeError("baseline GET missed a key")

    def tier_store(rep: int) -> None:
        tier.submit_store(next(job), tier_keys, slots)
        results = tier.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError("tier store failed")

    def clear() -> None:
        # both paths write keys the server does not hold (it reuses the freed memory), and
        # the tier must not skip keys it knows are present
        tier.forget_answers()
        pipe = client.pipeline(transaction=False)
        for key in tier_keys:
            pipe.delete(tier.redis_key(key))
        for raw in raw_keys:
            pipe.delete(raw)
        pipe.execute()

    def tier_load(rep: int) -> None:
        tier.submit_load(next(job), tier_keys, slots)
        results = tier.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError("tier promotion failed")

    # the two paths alternate pass by pass, so that both see the same machine load
    names = ("baseline_store", "tier_store", "baseline_load", "tier_load")
    out = dict.fromkeys(names + tuple(n + "_cpu" for n in names), 1e30)

    def record(name: str, fn: Callable[[int], None], rep: int) -> None:
        wall, cpu = _timed(fn, rep)
        out[name] = min(out[name], wall)
        out[name + "_cpu"] = min(out[name + "_cpu"], cpu)

    for rep in range(repeat):
        for name, fn in (("baseline_store", base_store), ("tier_store", tier_store)):
            clear()
            record(name, fn, rep)
    base_store(0)  # the baseline's keys, for its GETs
    tier_store(0)
    # scribble over the pool, so the promotion must bring every byte back
    for r in range(pool.num_regions):
        pool.region(r)[:] = bytes(len(pool.region(r)))
    for rep in range(repeat):
        for name, fn in (("baseline_load", base_load), ("tier_load", tier_load)):
            record(name, fn, rep)
    out["ok"] = float(all(pool.read_slot(s) == payloads[s] for s in slots))
    out["bytes"] = float(n * chunk_bytes)
    clear()
    tier.shutdown()
    client.close()
    pool.close()
    return out


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected KiB sizes like 256,1024, got {text!r}"
        ) from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options."""
    p.add_argument("--url", help="an existing server (default: start redis-server on loopback)")
    p.add_argument("--cluster", action="store_true", help="--url is a cluster node")
    p.add_argument("--chunk-kib", type=_sizes, default="256,1024,2048", help="chunk sizes in KiB")
    p.add_argument(
        "--total-mib", type=int_range(1), default=64, help="payload per pass and chunk size"
    )
    p.add_argument("--repeat", type=int_range(1), default=5, help="passes per path (best kept)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    return run_module(__name__, argv)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed ``args`` and print the table."""
    sizes = [k << 10 for k in args.chunk_kib]
    server = None
    url = args.url
    if url is None:
        from statecore.services.redisserver import LocalRedis

        server = LocalRedis().start()
        url = server.url
    try:
        import redis

        print(
            f"RedisTier vs plain pipelined SET/GET, same client (redis-py {redis.__version__}), "
            f"server {url}; payload {args.total_mib} MiB per pass, best of {args.repeat}"
        )
        print(
            f"{'chunk':>8} {'direction':>9} {'baseline GB/s':>14} {'tier GB/s':>10} {'ratio':>6} "
            f"{'client CPU ratio':>16}"
        )
        bad = False
        for size in sizes:
            res = measure(url, size, args.total_mib << 20, args.repeat, args.cluster)
            gb = res["bytes"] / 1e9
            for direction in ("store", "load"):
                base, tier = res[f"baseline_{direction}"], res[f"tier_{direction}"]
                cpu = res[f"baseline_{direction}_cpu"] / max(res[f"tier_{direction}_cpu"], 1e-9)
                print(
                    f"{size >> 10:>7}K {direction:>9} {gb / base:>14.2f} {gb / tier:>10.2f} "
                    f"{base / tier:>6.2f} {cpu:>16.2f}"
                )
            if not res["ok"]:
                print(f"MISMATCH: promoted bytes differ at chunk size {size}")
                bad = True
        return 1 if bad else 0
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    sys.exit(main())
