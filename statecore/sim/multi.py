"""Several engine instances sharing one Redis tier, in the simulator.

Each instance is a whole simulated stack (:class:`~statecore.sim.run.SimStack`: its own
scheduler, CPU tier, pool, workers and torch adapter, its own GPU KV tensors) whose tiering
manager has one secondary tier, a :class:`~statecore.managers.redistier.RedisTier` on a
shared server. The instances step in lockstep, one step each per round.

**Routing.** One :class:`~statecore.sim.workload.Workload` (seeded as a single engine's would
be) produces the turns; a router sends turn ``t`` of conversation ``c`` to instance
``(c + t) mod N``, so a follow-up turn lands on another instance than the turn before it, as
behind a load balancer without session affinity. Its long prefix (the previous prompt and
output) can then only come from the shared tier, or be recomputed.

**Oracle across instances.** A block's bytes are a function of its hash (and rank, tensor),
the same in every instance, so each engine's data oracle checks loaded bytes whichever
instance stored them.

**Server restart.** With ``restart=True`` (and a server this module started), the server is
stopped once half the requests have been issued and started again, empty, ``down_steps``
rounds later or, when no tier job has failed by then, as soon as one has (at most 20 times
``down_steps`` rounds): whether a job meets the down server depends on when the tier's
threads run it, so the outage lasts until it has been felt. Promotions and stores fail,
lookups answer MISS, requests recompute; the run must still end with no violation and no data error.
An operator's server (``url`` without ``server``) is never stopped by this module; whoever
restarts it, every restart is detected from the server's ``run_id`` (asked once a round) and
counted in :attr:`MultiReport.server_restarts`, and the tiers log their faults and recovery
(logger ``statecore.managers.redistier``).

**Namespaces.** :func:`compare` puts every key of its three runs under one fresh prefix
(``statecore-sim-<random hex>``), so a run never reads what an earlier run left on the same
server, and deletes them at the end unless ``keep_keys``.

**Comparison.** :func:`compare` runs the same workload three times: on one instance, on N
instances sharing the tier, and on N instances with private tiers (a namespace each, same
server); it reports each run's hit rate and, for the shared run, the promoted chunks that
another instance had stored (the cross-instance hits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from statecore.keys import OffloadKey
from statecore.manager import OffloadingManager
from statecore.managers.cpu import CPUOffloadingManager
from statecore.managers.filetier import InlineExecutor
from statecore.managers.redistier import (
    RedisTier,
    RedisTierConfig,
    TierLayout,
    delete_keys,
    public_url,
)
from statecore.managers.tiering import TieringOffloadingManager
from statecore.managers.tiers import FAULT_KINDS, JobResult
from statecore.sim.engine import SimConfig, SimEngine
from statecore.sim.report import SimReport
from statecore.sim.run import SimStack, _report, attach_store_oracle
from statecore.sim.workload import Turn, Workload

__all__ = [
    "Comparison",
    "InstanceStack",
    "MultiReport",
    "RoutedWorkload",
    "Router",
    "compare",
    "run_instances",
]

_log = logging.getLogger(__name__)

RoundCallback = Callable[[int, int], None]
"""``on_round(round, rounds)``: called after every round of a run (progress)."""


class InstanceStack(SimStack):
    """A simulated stack whose tiering manager has one RedisTier (run inline)."""

    redis_tier: RedisTier

    def __init__(self, cfg: SimConfig, tier_config: RedisTierConfig) -> None:
        self.tier_config = tier_config
        super().__init__(cfg)

    def _make_manager(self) -> OffloadingManager:
        # SimStack.__init__ calls this once the pool exists
        self.redis_tier = RedisTier(self.tier_config, self.pool, executor=InlineExecutor())
        return TieringOffloadingManager(CPUOffloadingManager(self.cfg.cpu_slots), [self.redis_tier])


class Router:
    """Splits one workload's turns over ``n`` instances (module docstring)."""

    def __init__(self, workload: Workload, n: int) -> None:
        self.workload = workload
        self.n = n
        self._step = -1
        self._pending: list[list[Turn]] = [[] for _ in range(n)]

    def instance_of(self, turn: Turn) -> int:
        """The instance that serves ``turn``."""
        idx = int(turn.req_id.rsplit("t", 1)[1])
        return (turn.conv + idx) % self.n

    def arrivals(self, instance: int, step: int) -> list[Turn]:
        """The turns of ``step`` routed to ``instance`` (the workload is asked once a step)."""
        if step != self._step:
            self._step = step
            for turn in self.workload.arrivals(step):
                self._pending[self.instance_of(turn)].append(turn)
        out, self._pending[instance] = self._pending[instance], []
        return out

    def exhausted(self, instance: int) -> bool:
        """No more turns for ``instance``."""
        return self.workload.exhausted and not self._pending[instance]


class RoutedWorkload(Workload):
    """One instance's view of a :class:`Router` (what its engine calls its workload)."""

    def __init__(self, router: Router, instance: int) -> None:  # no own random stream
        self.router = router
        self.instance = instance
        self.cfg = router.workload.cfg

    @property
    def exhausted(self) -> bool:
        """No more turns for this instance."""
        return self.router.exhausted(self.instance)

    def arrivals(self, step: int) -> list[Turn]:
        """This instance's turns of ``step``."""
        return self.router.arrivals(self.instance, step)

    def turn_ended(self, turn: Turn, step: int, completed: bool) -> None:
        """Tell the shared workload (it plans the follow-up)."""
        self.router.workload.turn_ended(turn, step, completed)

    def next_token(self) -> int:
        """A sampled token from the shared stream."""
        return self.router.workload.next_token()


@dataclass
class MultiReport:
    """One run of N instances: each instance's report and the figures across them."""

    instances: list[SimReport]
    hit_rate: float
    """Hit tokens (local and loaded) over admitted prompt tokens, all instances together."""
    promoted_chunks: int = 0
    cross_instance_chunks: int = 0
    """Promoted chunks that another instance had stored."""
    server_restarts: int = 0
    """Server restarts seen during the run (its ``run_id`` changed), whoever restarted it."""
    failed_tier_jobs: int = 0
    """Store and promotion jobs of the tier that failed (server down, missing values)."""
    tier_stats: dict[str, int] = field(default_factory=dict)
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    """:attr:`failed_tier_jobs` by fault kind (:data:`~statecore.managers.tiers.FAULT_KINDS`)."""

    @property
    def ok(self) -> bool:
        """Every instance's run is clean."""
        return all(r.ok for r in self.instances)

    def figures(self) -> dict[str, Any]:
        """The run's figures (for JSON)."""
        return {
            "hit_rate": self.hit_rate,
            "promoted_chunks": self.promoted_chunks,
            "cross_instance_chunks": self.cross_instance_chunks,
            "server_restarts": self.server_restarts,
            "failed_tier_jobs": self.failed_tier_jobs,
            "failed_tier_jobs_by_kind": dict(self.failed_by_kind),
            "violations": self.violations,
            "data_errors": self.data_errors,
            "ok": self.ok,
            "tier": dict(self.tier_stats),
        }

    @property
    def violations(self) -> int:
        """Invariant violations over all instances."""
        return sum(len(r.invariant_violations) for r in self.instances)

    @property
    def data_errors(self) -> int:
        """Data errors over all instances."""
        return sum(len(r.data_errors) for r in self.instances)


def _layout(cfg: SimConfig) -> TierLayout:
    return TierLayout(
        "statecore-sim", "uint8", (cfg.num_tensors, cfg.page_bytes), cfg.blocks_per_chunk
    )


class _Attribution:
    """Which instance stored which key first, and whose keys each promotion brought in."""

    def __init__(self) -> None:
        self.stored_by: dict[bytes, int] = {}
        self.promoted = 0
        self.cross = 0
        self.failed_jobs = 0

    def watch(self, tier: RedisTier, instance: int) -> None:
        jobs: dict[int, tuple[bool, tuple[OffloadKey, ...]]] = {}
        real_store, real_load, real_finished = (
            tier.submit_store,
            tier.submit_load,
            tier.get_finished,
        )

        def submit_store(job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
            jobs[job_id] = (True, tuple(keys))
            real_store(job_id, keys, slots)

        def submit_load(job_id: int, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
            jobs[job_id] = (False, tuple(keys))
            real_load(job_id, keys, slots)

        def get_finished() -> list[JobResult]:
            results = real_finished()
            for res in results:
                is_store, keys = jobs.pop(res.job_id, (True, ()))
                self.failed_jobs += not res.success
                ok = set(keys) if res.success else set(res.successful_keys or ())
                for key in keys:
                    if key not in ok:
                        continue
                    where = tier.redis_key(key)  # namespace and key: private tiers differ
                    if is_store:
                        self.stored_by.setdefault(where, instance)
                    else:
                        self.promoted += 1
                        if self.stored_by.get(where, instance) != instance:
                            self.cross += 1
            return results

        tier.submit_store = submit_store  # type: ignore[method-assign]
        tier.submit_load = submit_load  # type: ignore[method-assign]
        tier.get_finished = get_finished  # type: ignore[method-assign]


def run_instances(
    cfg: SimConfig,
    url: str,
    instances: int = 2,
    prefix: str = "sim",
    shared: bool = True,
    server: Any = None,
    restart: bool = False,
    down_steps: int = 10,
    max_known_keys: int | None = None,
    on_round: RoundCallback | None = None,
) -> MultiReport:
    """Run ``instances`` stacks in lockstep over one routed workload (module docstring).

    Args:
        cfg: every instance's configuration (``tiering`` is implied).
        url: the Redis server.
        instances: how many engine stacks.
        prefix: the key prefix (``shared=False`` appends the instance number to it).
        shared: one namespace for all (sharing) or one per instance (no sharing).
        server: the :class:`~statecore.services.redisserver.LocalRedis` behind ``url``, needed to
            restart it.
        restart: stop the server once half the requests were issued, start it
            ``down_steps`` rounds later, or later once a tier job has failed (at most
            ``20 * down_steps`` rounds).
        max_known_keys: every tier's ``max_known_keys`` (None: the tier's default).
        on_round: called after every round with the round and ``cfg.steps`` (progress).
    """
    cfg = dataclasses.replace(cfg, tiering=True)
    root = random.Random(cfg.seed)
    root.getrandbits(64)  # the engine's own stream comes first, as in SimEngine
    router = Router(Workload(cfg.workload, random.Random(root.getrandbits(64))), instances)
    attribution = _Attribution()
    stacks: list[InstanceStack] = []
    engines: list[SimEngine] = []
    restarts = 0
    try:
        for i in range(instances):
            tier_cfg = RedisTierConfig(
                url=url,
                layout=_layout(cfg),
                prefix=prefix if shared else f"{prefix}{i}",
                timeout_s=5.0,
                lookup_ttl_steps=8,
            )
            if max_known_keys is not None:
                tier_cfg = dataclasses.replace(tier_cfg, max_known_keys=max_known_keys)
            # every instance draws its own faults and delays
            stack = InstanceStack(dataclasses.replace(cfg, seed=cfg.seed + 7919 * i), tier_cfg)
            sched = stack.scheduler
            engine = SimEngine(
                stack.cfg,
                sched,
                stack.ranks,
                stack.kv,
                stack.clock,
                in_flight=lambda s=sched: len(s.jobs),  # type: ignore[misc]
            )
            engine.extra_pending = lambda s=sched: bool(s.stalled_jobs)  # type: ignore[misc]
            engine.workload = RoutedWorkload(router, i)
            attach_store_oracle(stack, engine)
            attribution.watch(stack.redis_tier, i)
            log = stack.redis_tier.fault_log
            log.tier = f"instance {i}: {log.tier}"
            stacks.append(stack)
            engines.append(engine)
        restart_at: int | None = None
        failed_before = 0
        half = cfg.workload.num_requests // 2
        step = 0
        probe = stacks[0].redis_tier if stacks else None
        run_id = probe.run_id() if probe is not None else None
        where = public_url(url)

        def watch_run_id() -> int:
            """1 when the server's run_id changed since the last answer (a restart)."""
            nonlocal run_id
            now = probe.run_id() if probe is not None else None
            if now is None or now == run_id:
                return 0
            changed = run_id is not None
            if changed:
                _log.warning(
                    "the Redis server at %s restarted (run_id %s -> %s): what it held is gone",
                    where,
                    run_id[:8] if run_id else "?",
                    now[:8],
                )
            run_id = now
            return int(changed)

        while step < cfg.steps and not all(e.workload.exhausted and not e.by_id for e in engines):
            if restart and server is not None:
                if restart_at is None and router.workload.issued >= half and server.running:
                    _log.info("stopping the Redis server at %s (the restart under test)", where)
                    server.stop()
                    restart_at = step + down_steps
                    failed_before = attribution.failed_jobs
                elif (
                    restart_at is not None
                    and not server.running
                    and step >= restart_at
                    and (
                        attribution.failed_jobs > failed_before
                        or step >= restart_at + 19 * down_steps
                    )
                ):
                    _log.info("starting the Redis server at %s again, empty", where)
                    server.start()
            for e in engines:
                e.step(admit=True)
            step += 1
            restarts += watch_run_id()
            if on_round is not None:
                on_round(step, cfg.steps)
        if server is not None and not server.running:
            server.start()
        restarts += watch_run_id()
        for e in engines:
            for r in list(e.by_id.values()):
                if not r.aborted:
                    e.abort(r)
        for e in engines:
            e.drain()
        for stack, engine in zip(stacks, engines, strict=True):
            stack.shut_down = True
            engine.shutdown()  # under INV-MGR-ERROR, as every engine ends
        reports: list[SimReport] = []
        tier_stats: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for stack, engine in zip(stacks, engines, strict=True):
            rep = _report(stack.cfg, stack, engine)
            for name, value in rep.bytes_moved.items():
                if name.startswith("redis"):
                    key = name.split(".", 1)[1]
                    tier_stats[key] = tier_stats.get(key, 0) + value
            for name, value in rep.tier_faults.items():
                kind = name.split(" ", 1)[1]
                by_kind[kind] = by_kind.get(kind, 0) + value
            reports.append(rep)
        hits = sum(e.stats.local_hit_tokens + e.stats.tokens_loaded for e in engines)
        admitted = sum(e.admitted_prompt_tokens for e in engines)
        return MultiReport(
            instances=reports,
            hit_rate=hits / admitted if admitted else 0.0,
            promoted_chunks=attribution.promoted,
            cross_instance_chunks=attribution.cross,
            server_restarts=restarts,
            failed_tier_jobs=attribution.failed_jobs,
            tier_stats=tier_stats,
            failed_by_kind={k: by_kind[k] for k in FAULT_KINDS if k in by_kind},
        )
    finally:
        for stack in stacks:
            stack.close()


@dataclass
class Comparison:
    """The same workload on one instance, on N sharing the tier, on N with private tiers."""

    single: MultiReport
    shared: MultiReport
    private: MultiReport
    namespace: str = ""
    """The key prefix of the three runs' keys on the server."""
    keys_removed: int | None = None
    """Keys deleted at the end (``None``: kept, or the server did not answer)."""

    @property
    def ok(self) -> bool:
        """Every run is clean."""
        return self.single.ok and self.shared.ok and self.private.ok

    def to_dict(self) -> dict[str, Any]:
        """The three runs' figures."""
        return {
            "single": self.single.figures(),
            "shared": self.shared.figures(),
            "private": self.private.figures(),
            "namespace": self.namespace,
            "keys_removed": self.keys_removed,
            "ok": self.ok,
        }

    def format_text(self) -> str:
        """The comparison as a small table, then each run's problems if any."""
        n = len(self.shared.instances)
        lines = [
            f"{'run':<34} {'hit rate':>8} {'promoted':>9} {'from other':>10} "
            f"{'violations':>10} {'data errors':>11}",
        ]
        for name, rep in (
            ("1 instance", self.single),
            (f"{n} instances, shared Redis tier", self.shared),
            (f"{n} instances, private tiers", self.private),
        ):
            lines.append(
                f"{name:<34} {rep.hit_rate:>8.3f} {rep.promoted_chunks:>9} "
                f"{rep.cross_instance_chunks:>10} {rep.violations:>10} {rep.data_errors:>11}"
            )
        lines.append(
            f"sharing gains {self.shared.hit_rate - self.private.hit_rate:+.3f} hit rate over "
            f"private tiers ({self.shared.hit_rate / self.single.hit_rate:.2f}x of the single "
            f"instance's); server restarts during the shared run: {self.shared.server_restarts}, "
            f"failed tier jobs: {self.shared.failed_tier_jobs}"
            if self.single.hit_rate
            else "no hits at all"
        )
        for name, rep in (
            ("1 instance", self.single),
            (f"{n} instances, shared", self.shared),
            (f"{n} instances, private", self.private),
        ):
            if rep.failed_by_kind:
                lines.append(
                    f"failed tier jobs by kind ({name}): "
                    + ", ".join(f"{k} {v}" for k, v in rep.failed_by_kind.items())
                )
        if self.namespace:
            lines.append(
                f"keys under {self.namespace}: "
                + (
                    "kept (--keep-keys)"
                    if self.keys_removed is None
                    else f"{self.keys_removed} removed at the end"
                )
            )
        for name, rep in (
            ("single", self.single),
            ("shared", self.shared),
            ("private", self.private),
        ):
            for i, r in enumerate(rep.instances):
                if not r.ok:
                    lines.append(f"--- {name} run, instance {i} ---")
                    lines.append(r.format_text())
        return "\n".join(lines)


def compare(
    cfg: SimConfig,
    instances: int = 2,
    url: str | None = None,
    restart: bool = True,
    keep_keys: bool = False,
    namespace: str | None = None,
    on_round: Callable[[str, int, int], None] | None = None,
) -> Comparison:
    """Run :class:`Comparison`'s three runs; without ``url`` a local server is started.

    Args:
        cfg: the workload and every instance's configuration.
        instances: instances of the shared and private runs.
        url: an operator's server (never stopped here; restarts are detected and counted).
        restart: restart the server this function starts, mid-run (not an operator's).
        keep_keys: leave the runs' keys on the server (they are deleted otherwise).
        namespace: the runs' key prefix (default ``statecore-sim-<8 random hex digits>``).
        on_round: called after every round with the run's name, the round and the rounds.
    """
    server: Any = None
    if url is None:
        from statecore.services.redisserver import LocalRedis

        server = LocalRedis().start()
        url = server.url
    ns = namespace or f"statecore-sim-{secrets.token_hex(4)}"

    def progress(name: str) -> RoundCallback | None:
        if on_round is None:
            return None
        return lambda done, total: on_round(name, done, total)

    _log.info("keys of this run go under the prefix %s on %s", ns, public_url(url))
    try:
        single = run_instances(cfg, url, 1, prefix=f"{ns}-single", on_round=progress("single"))
        shared = run_instances(
            cfg,
            url,
            instances,
            prefix=f"{ns}-shared",
            server=server,
            restart=restart and server is not None,
            on_round=progress("shared"),
        )
        private = run_instances(
            cfg, url, instances, prefix=f"{ns}-private", shared=False, on_round=progress("private")
        )
        removed = None if keep_keys else _remove_keys(url, ns)
        return Comparison(single, shared, private, namespace=ns, keys_removed=removed)
    finally:
        if server is not None:
            server.close()


def _remove_keys(url: str, namespace: str) -> int | None:
    """Delete the keys under ``namespace``; ``None`` (logged) when the server does not answer."""
    client = RedisTierConfig(url=url, timeout_s=5.0).make_client()
    try:
        return delete_keys(client, namespace.encode())
    except Exception as exc:
        _log.warning(
            "could not delete the keys under %s on %s (%s); `statecore tier clear %s "
            "--redis-url URL` deletes them",
            namespace,
            public_url(url),
            type(exc).__name__,
            namespace,
        )
        return None
    finally:
        with contextlib.suppress(Exception):
            client.close()
