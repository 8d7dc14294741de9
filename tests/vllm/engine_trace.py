"""The connector calls of one seeded workload, step by step, through two engines: vLLM 0.33's
real ``Scheduler`` (with :class:`~statecore.adapters.vllm.StatecoreOffloadingConnector`) and
statecore's engine model (:class:`~statecore.sim.engine.SimEngine`), both over statecore's
:class:`~statecore.scheduler.OffloadingScheduler`.

Each call that reaches the scheduler is recorded, normalised to plain tuples (hook name,
request ids, block ids, token counts), under the engine step it happened in; the two traces
are then compared step by step (:func:`first_divergence`). Both sides run one worker rank
whose copies complete in the step they were submitted in (the simulator's fault preset
``none``; vLLM's side a backend with no delay), so a difference is the engine's own.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

BLOCK = 16
"""Tokens per GPU block (every group), as in the peer harness."""

STEP_SECONDS = 0.5
"""The clock both sides' schedulers read moves on this much as each engine step begins (the
engine model's :class:`~statecore.sim.engine.SimClock`); the scheduler's stall timeout and
its bound on waiting for another request's load are in those seconds."""


@dataclass(frozen=True)
class Arrival:
    """One request of the workload: when it arrives and, perhaps, when it is aborted."""

    step: int
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    abort_at: int | None = None


@dataclass(frozen=True)
class Shape:
    """The engine both sides run: KV groups, block counts, budgets."""

    groups: str = "full"  # a statecore.sim.engine.GROUP_PRESETS name: "full" or "hybrid"
    num_gpu_blocks: int = 48  # null block 0 included
    num_cpu_chunks: int = 512
    blocks_per_chunk: int = 1
    max_batched_tokens: int = 128
    max_running: int = 8
    prefix_caching: bool = True  # vLLM's local prefix cache (the checker's engine has none)
    counted_tokens: bool = False  # generated tokens 100, 101, ... (the checker's) not random
    stall_timeout_s: float = 20.0  # the scheduler's (the simulator's default; the checker's: 10)
    stall_check_interval_s: float = 2.0
    offload_prompt_only: bool = False  # the benchmark's connector: True
    load_delay: int = 0  # engine steps from a load's submission to its report
    store_delay: int = 0  # the same for a store
    load_fail_every: int = 0  # the n-th, 2n-th, ... load job the worker runs fails (0: none)
    reset_steps: tuple[int, ...] = ()  # the operator resets the caches before these steps


def workload(
    seed: int,
    n: int = 24,
    steps: int = 40,
    prefixes: int = 3,
    prefix_len: int = 64,
    suffix_len: tuple[int, int] = (8, 72),
    output_len: tuple[int, int] = (4, 24),
    abort_prob: float = 0.15,
) -> list[Arrival]:
    """``n`` requests arriving over ``steps`` steps: a shared prefix (one of ``prefixes``)
    and a unique suffix each; some are aborted a few steps after arrival."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, 50000) for _ in range(k)]

    shared = [tokens(prefix_len) for _ in range(prefixes)]
    out = []
    for i in range(n):
        step = sorted(rng.randrange(steps) for _ in range(1))[0] if i >= 4 else 0
        prompt = shared[rng.randrange(prefixes)] + tokens(rng.randint(*suffix_len))
        abort = step + rng.randint(1, 6) if rng.random() < abort_prob else None
        out.append(Arrival(step, f"c{i}t0", tuple(prompt), rng.randint(*output_len), abort))
    out.sort(key=lambda a: (a.step, int(a.req_id[1:-2])))
    return out


# -- the trace -------------------------------------------------------------------------------

Call = tuple[Any, ...]


@dataclass
class Trace:
    """The scheduler calls, per engine step (calls between steps count to the next one)."""

    step: int = 0
    calls: dict[int, list[Call]] = field(default_factory=lambda: defaultdict(list))

    def add(self, call: Call) -> None:
        self.calls[self.step].append(call)

    def steps(self) -> list[int]:
        return sorted(self.calls)

    def merge_outputs(self) -> None:
        """One ``output`` call per step, the union of the step's (an engine that delivers
        each worker report on its own makes several where vLLM's makes one)."""
        for step, calls in self.calls.items():
            outs = [c for c in calls if c[0] == "output"]
            if len(outs) < 2:
                continue
            merged = ("output",) + tuple(
                tuple(sorted({x for c in outs for x in c[i]})) for i in (1, 2, 3)
            )
            first = calls.index(outs[0])
            rest = [c for c in calls if c[0] != "output"]
            self.calls[step] = rest[:first] + [merged] + rest[first:]


def _blocks(lists: Any) -> tuple[tuple[int, ...], ...]:
    if lists is None:
        return ()
    return tuple(tuple(int(b) for b in g) for g in lists)


def _scheduled(output: Any) -> list[Call]:
    rows = [
        (
            e.req_id,
            _blocks(e.new_block_ids),
            int(e.num_scheduled_tokens),
            bool(e.resumed_from_preemption),
        )
        for e in output.scheduled
    ]
    cols = output.columns
    if cols is not None:
        for rid, blocks, n in zip(
            cols.req_ids, cols.new_block_ids, cols.num_scheduled_tokens, strict=True
        ):
            rows.append((rid, _blocks(blocks), int(n), rid in cols.resumed_req_ids))
    # a request that got no new blocks: the same whether the engine sends () or ((), ())
    return sorted((r, b if any(b) else (), n, res) for r, b, n, res in rows)


def _jobs(jobs: Any) -> list[Call]:
    out = []
    for job_id, job in sorted(jobs.items()):
        ends = []
        for spec in (job.src, job.dst):
            ids = getattr(spec, "block_ids", None)
            ends.append(tuple(int(b) for b in ids) if ids is not None else None)
        out.append((int(job_id), job.req_id, *ends))
    return out


def record(sched: Any, trace: Trace) -> None:
    """Wrap ``sched``'s engine-facing methods (on the instance) so every call lands in
    ``trace``, normalised."""

    def wrap(name: str, note: Callable[[tuple[Any, ...], Any], Call | None]) -> None:
        real = getattr(sched, name)

        def call(*args: Any) -> Any:
            out = real(*args)
            row = note(args, out)
            if row is not None:
                trace.add(row)
            return out

        setattr(sched, name, call)

    wrap("on_new_request", lambda a, _: ("new", a[0].request_id))
    wrap(
        "get_num_new_matched_tokens",
        lambda a, out: ("lookup", a[0].request_id, int(a[1]), tuple(out)),
    )
    wrap(
        "update_state_after_alloc",
        lambda a, _: ("alloc", a[0].request_id, _blocks(a[1]), int(a[2])),
    )

    def build(a: tuple[Any, ...], meta: Any) -> Call:
        o = a[0]
        return (
            "build",
            tuple(_scheduled(o)),
            tuple(sorted(o.new_req_ids)),
            tuple(sorted(o.finished_req_ids)),
            tuple(sorted(o.preempted_req_ids)),
            tuple(_jobs(meta.load_jobs)),
            tuple(_jobs(meta.store_jobs)),
            tuple(sorted(meta.jobs_to_flush)),
        )

    wrap("build_connector_meta", build)

    def output(a: tuple[Any, ...], res: Any) -> Call | None:
        done = tuple(sorted(res.finished_loads)) if res is not None else ()
        bad = tuple(sorted(res.invalid_block_ids)) if res is not None else ()
        rep = a[0]
        ended = tuple(sorted(rep.completed)) if rep is not None else ()
        if not (done or bad or ended):
            return None  # an empty report: engines differ in whether they send one
        return ("output", ended, done, bad)

    wrap("update_connector_output", output)
    wrap("request_finished", lambda a, _: ("finished", a[0].request_id))
    wrap(
        "reset",
        lambda _, out: (
            "reset",
            out.status.name,
            tuple(sorted(out.flushed_jobs)),
            tuple(sorted(out.discarded_jobs)),
            tuple(sorted(out.discarded_loads)),
            tuple(sorted(out.carried_loads)),
        ),
    )


def first_divergence(a: Trace, b: Trace) -> str | None:
    """Where two traces first differ (None: the same, step by step)."""
    for step in sorted(set(a.calls) | set(b.calls)):
        x, y = a.calls.get(step, []), b.calls.get(step, [])
        if x == y:
            continue
        i = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        if i is None:
            i = min(len(x), len(y))
        left = x[i] if i < len(x) else "<nothing>"
        right = y[i] if i < len(y) else "<nothing>"
        return f"step {step}, call {i}:\n  vllm:   {left}\n  engine: {right}"
    return None


# -- the engine model ------------------------------------------------------------------------


class DelayLoads:
    """A transfer backend wrapper: a load's result is reported ``delay`` engine steps after
    its submission (``step()`` reads the engine's step), or at once when a flush waits for
    it, as the benchmark's backend does on vLLM's side (``StepDelayBackend``)."""

    def __init__(self, inner: Any, delay: int, step: Callable[[], int]) -> None:
        self.inner = inner
        self.delay = delay
        self.step = step
        self.due: dict[int, int] = {}  # load job -> step its result may be reported
        self.held: list[Any] = []

    def submit(self, job_id: int, job: Any, is_store: bool) -> None:
        if not is_store:
            self.due[job_id] = self.step() + self.delay
        self.inner.submit(job_id, job, is_store)

    def poll(self) -> list[Any]:
        self.held += self.inner.poll()
        now = self.step()
        out = [r for r in self.held if self.due.get(r.job_id, now) <= now]
        self.held = [r for r in self.held if self.due.get(r.job_id, now) > now]
        for r in out:
            self.due.pop(r.job_id, None)
        return out

    def wait(self, job_ids: Any) -> None:
        for j in job_ids:
            if j in self.due:
                self.due[j] = -1
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FailEveryLoad:
    """A transfer backend wrapper: the ``n``-th, ``2n``-th, ... load job submitted fails (not
    run, reported failed at the next poll), as the benchmark's backend fails loads on vLLM's
    side (``StepDelayBackend(fail_every=n)``)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner = inner
        self.n = n
        self.loads = 0
        self.failed: list[Any] = []

    def submit(self, job_id: int, job: Any, is_store: bool) -> None:
        if not is_store:
            self.loads += 1
            if self.loads % self.n == 0:
                from statecore.worker import TransferResult

                self.failed.append(TransferResult(job_id, False, 0, 0.0, False))
                return
        self.inner.submit(job_id, job, is_store)

    def poll(self) -> list[Any]:
        out, self.failed = self.failed, []
        return out + list(self.inner.poll())

    def wait(self, job_ids: Any) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_engine_model(shape: Shape, arrivals: Sequence[Arrival], max_steps: int = 400) -> Trace:
    """The workload through :class:`~statecore.sim.engine.SimEngine`."""
    from statecore.sim.engine import SimConfig
    from statecore.sim.faults import SimFaults
    from statecore.sim.run import build_stack
    from statecore.sim.workload import Turn, WorkloadConfig

    cfg = SimConfig(
        seed=0,
        steps=max_steps,
        num_workers=1,
        faults=SimFaults.preset("none"),
        groups=shape.groups,
        tokens_per_block=BLOCK,
        blocks_per_chunk=shape.blocks_per_chunk,
        num_gpu_blocks=shape.num_gpu_blocks,
        cpu_slots=shape.num_cpu_chunks,
        max_batched_tokens=shape.max_batched_tokens,
        max_running=shape.max_running,
        watermark_blocks=0,
        foreign_prob=0.0,
        step_seconds=STEP_SECONDS,
        vllm_window=True,
        stall_timeout_s=20.0,
        stall_check_interval_s=2.0,
        # the engine model's own aborts of loading requests are off: the workload's are the
        # only ones, on both sides
        workload=WorkloadConfig(abort_during_load_prob=0.0),
    )
    stack, eng = build_stack(cfg)
    worker = stack.ranks[0].worker
    if shape.load_fail_every:  # (under the delay: a failed load is reported when it is due)
        worker._backend = FailEveryLoad(worker._backend, shape.load_fail_every)
    if shape.load_delay:
        worker._backend = DelayLoads(worker._backend, shape.load_delay, lambda: eng.step_no)
    trace = Trace()
    record(stack.scheduler, trace)
    by_step: dict[int, list[Arrival]] = defaultdict(list)
    aborts: dict[int, list[str]] = defaultdict(list)
    for a in arrivals:
        by_step[a.step].append(a)
        if a.abort_at is not None:
            aborts[a.abort_at].append(a.req_id)
    last = max(a.step for a in arrivals)
    try:
        for k in range(max_steps):
            trace.step = k
            for a in by_step.get(k, ()):
                eng.arrive(Turn(a.req_id, int(a.req_id[1:-2]), list(a.prompt), a.max_tokens))
            for rid in aborts.get(k, ()):
                r = eng.by_id.get(rid)
                if r is not None and not r.aborted:
                    eng.abort(r)
            if k > last and not eng.by_id and not eng.finished_since_last:
                break  # as vLLM's has_requests(): the finished ids are not yet sent
            if k in shape.reset_steps:
                eng.reset_cache()
            eng.step(admit=False)
    finally:
        stack.close()
    problems = eng.stats.errors + eng.stats.violations + eng.stats.harness_anomalies
    if problems:
        raise AssertionError(f"the engine model's run went wrong: {problems[:3]}")
    return trace


# -- the model checker's engine ---------------------------------------------------------------


def checker_scope(shape: Shape, arrivals: Sequence[Arrival]) -> Any:
    """The model checker's :class:`~statecore.check.model.Scope` for ``shape`` and the
    workload's prompts (request ``i`` of the world is the ``i``-th arrival): one worker, the
    world's default free order (``"lifo"``: the blocks a request frees are handed out next,
    its last block first, as vLLM's free-block queue does with blocks that hold no cached
    hash; vLLM runs without its prefix cache, which the world does not model), every request
    generating the same number of tokens (the world's ``max_output``)."""
    from statecore.check.model import Scope

    outputs = {a.max_tokens for a in arrivals}
    if len(outputs) != 1:
        raise ValueError(f"the checker's engine generates one length for all: {outputs}")
    window = None
    if shape.groups == "hybrid":
        from statecore.sim.engine import kv_groups

        window = next(g.sliding_window for g in kv_groups("hybrid", BLOCK) if g.sliding_window)
    return Scope(
        name="differential",
        prompts=tuple(a.prompt for a in arrivals),
        workers=1,
        sliding_window=window,
        gpu_blocks=shape.num_gpu_blocks - 1,
        cpu_slots=shape.num_cpu_chunks,
        tokens_per_block=BLOCK,
        max_output=outputs.pop(),
        max_batched_tokens=shape.max_batched_tokens,
        free_order="lifo",
        prefix_caching_hint=shape.prefix_caching,
    )


def run_checker_model(shape: Shape, arrivals: Sequence[Arrival], max_steps: int = 400) -> Trace:
    """The workload through the model checker's engine (:class:`~statecore.check.model.World`):
    arrivals and aborts before their step, one ``("step",)``, then every copy the step
    submitted delivered (``("ok", 0, job)``), as vLLM's side completes them in the step."""
    from statecore.check.model import World

    world = World(checker_scope(shape, arrivals))
    trace = Trace()
    record(world.sched, trace)
    index = {a.req_id: i for i, a in enumerate(arrivals)}
    last = max(a.step for a in arrivals)
    loads = 0
    submitted_at: dict[int, int] = {}  # job -> the step it was submitted in
    for k in range(max_steps):
        trace.step = k
        world.clock.now = k * STEP_SECONDS  # as vLLM's side: arrivals, aborts, then the step
        for a in arrivals:
            if a.step == k:
                world.apply(("arrive", index[a.req_id]))
        for a in arrivals:
            if a.abort_at == k:
                r = world.reqs[index[a.req_id]]
                if r.status not in (0, 4) and not r.aborted:  # arrived, not done
                    world.apply(("abort", r.idx))
        if k > last and not world.engine_has_work():
            break
        if k in shape.reset_steps:
            world.apply(("reset",))
        world.clock.now = (k + 1) * STEP_SECONDS
        world.apply(("step",))
        for be in world.backends:
            for job_id in be.submitted:
                submitted_at.setdefault(job_id, k)
        while True:
            ready = [
                a
                for a in world.actions()
                if a[0] == "ok"
                and (
                    world.backends[a[1]].submitted[a[2]][0]  # stores: at once
                    or world.backends[a[1]].submitted[a[2]][2]  # a flush waited for it
                    or k >= submitted_at[a[2]] + shape.load_delay
                )
            ]
            if not ready:
                break
            _, rank, job_id = ready[0]
            if shape.load_fail_every and not world.backends[rank].submitted[job_id][0]:
                loads += 1
                if loads % shape.load_fail_every == 0:
                    world.apply(("fail", rank, job_id))
                    continue
            world.apply(ready[0])
        if world.errors:
            raise AssertionError(f"the checker's engine went wrong: {world.errors[:3]}")
    trace.merge_outputs()
    return trace


# -- the benchmark's engine loop --------------------------------------------------------------


def bench_shape(sc: Any) -> Shape:
    """The vLLM engine a benchmark scenario (:class:`~statecore.bench.scheduler.Scenario`)
    describes: one full-attention group, its block counts, budgets and report delays, the
    benchmark's connector configuration (prompt tokens offloaded only)."""
    return Shape(
        groups="full",
        num_gpu_blocks=sc.num_gpu_blocks(),  # the null block included, as the loop's pool
        num_cpu_chunks=sc.num_cpu_chunks(),
        max_batched_tokens=sc.max_num_batched_tokens,
        max_running=sc.concurrency,
        stall_timeout_s=300.0,  # statecore's defaults: the benchmark's connector has them
        stall_check_interval_s=10.0,
        offload_prompt_only=True,
        load_delay=sc.load_delay,
        store_delay=sc.store_delay,
    )


def run_bench_model(sc: Any) -> tuple[Trace, list[Arrival], dict[str, list[int]]]:
    """The benchmark scenario ``sc`` through the benchmark's own engine loop
    (:func:`~statecore.bench.scheduler.run_standalone`): its trace, and what it generated
    (each request's arrival step, prompt and length; its generated tokens), for vLLM's side
    to replay (:func:`run_vllm_engine` with ``sampled``)."""
    from statecore.bench.scheduler import Workload, run_standalone

    trace = Trace()
    arrivals: list[Arrival] = []
    tokens: dict[str, list[int]] = defaultdict(list)

    class Recorded(Workload):
        def new(self) -> tuple[str, list[int], int]:
            rid, prompt, out = super().new()
            arrivals.append(Arrival(trace.step, rid, tuple(prompt), out))
            return rid, prompt, out

        def sample(self, req_id: str) -> int:
            token = super().sample(req_id)
            tokens[req_id].append(token)
            return token

    def next_step(step: int, *_: Any) -> bool:
        trace.step = step
        return False

    run_standalone(sc, next_step, workload=Recorded(sc), observe=lambda sched: record(sched, trace))
    return trace, arrivals, dict(tokens)


# -- vLLM's engine ---------------------------------------------------------------------------


def _m(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def run_vllm_engine(
    shape: Shape,
    arrivals: Sequence[Arrival],
    max_steps: int = 400,
    sampled: dict[str, list[int]] | None = None,
) -> Trace:
    """The workload through vLLM's real ``Scheduler`` with statecore's connector; each
    request's ``i``-th generated token is ``sampled[req_id][i]`` when given (the tokens
    another engine generated), else as ``shape.counted_tokens`` says."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from statecore.bench.scheduler import StepDelayBackend, _model_dir

    torch = _m("torch")
    vcfg = _m("vllm.config")
    iface = _m("vllm.v1.kv_cache_interface")
    kvu = _m("vllm.v1.core.kv_cache_utils")
    base = _m("vllm.distributed.kv_transfer.kv_connector.v1.base")
    outputs_mod = _m("vllm.v1.outputs")
    status = _m("vllm.v1.request").RequestStatus
    SamplingParams = _m("vllm").SamplingParams
    VRequest = _m("vllm.v1.request").Request

    def spec(window: int | None) -> Any:
        kw = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
        if window is None:
            return iface.FullAttentionSpec(**kw)
        return iface.SlidingWindowSpec(sliding_window=window, **kw)

    from statecore.sim.engine import kv_groups

    groups = [
        iface.KVCacheGroupSpec([f"layer{i}"], spec(g.sliding_window))
        for i, g in enumerate(kv_groups(shape.groups, BLOCK))
    ]
    kcc = iface.KVCacheConfig(
        num_blocks=shape.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    extra = {
        "blocks_per_chunk": shape.blocks_per_chunk,
        "offload_prompt_only": shape.offload_prompt_only,
        "num_cpu_chunks": shape.num_cpu_chunks,
        "stall_timeout_s": shape.stall_timeout_s,
        "stall_check_interval_s": shape.stall_check_interval_s,
    }
    ktc = vcfg.KVTransferConfig(
        kv_connector="StatecoreOffloadingConnector",
        kv_connector_module_path="statecore.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        # the engine models' policy: a failed load's request recomputes what the load lost
        kv_load_failure_policy="recompute",
        engine_id=f"differential-{os.getpid()}-{id(arrivals)}",
    )
    model = _model_dir()
    cache_config = vcfg.CacheConfig(
        block_size=BLOCK,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=shape.prefix_caching,
    )
    vc = vcfg.VllmConfig(
        model_config=vcfg.ModelConfig(
            model=model,
            tokenizer=model,
            skip_tokenizer_init=True,
            dtype="float16",
            seed=0,
            max_model_len=16384,
        ),
        scheduler_config=vcfg.SchedulerConfig(
            max_num_seqs=shape.max_running,
            max_num_batched_tokens=shape.max_batched_tokens,
            max_model_len=16384,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=ktc,
        parallel_config=vcfg.ParallelConfig(tensor_parallel_size=1),
        device_config=vcfg.DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = shape.num_gpu_blocks
    engine = _m("vllm.v1.core.sched.scheduler").Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=_m("vllm.v1.structured_output").StructuredOutputManager(vc),
        block_size=BLOCK,
        log_stats=False,
    )
    conn = engine.connector
    trace = Trace()
    record(conn.scheduler, trace)
    # the engine model's clock: STEP_SECONDS a step, moved on as each step begins
    now = [0.0]
    conn.scheduler.clock = lambda: now[0]
    clock = [0]
    worker = type(conn)(vc, base.KVConnectorRole.WORKER, kcc)
    worker.attach_backend(
        StepDelayBackend(clock, shape.load_delay, shape.store_delay, shape.load_fail_every),
        rank=0,
    )
    aggregator = _m("vllm.distributed.kv_transfer.kv_connector.utils").KVOutputAggregator(
        expected_finished_count=1
    )
    hash_fn = _m("vllm.utils.hashing").get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    kvu.init_none_hash(hash_fn)
    hasher = kvu.get_request_block_hasher(BLOCK, hash_fn)
    token_rng = random.Random(1)
    given = sampled
    by_step: dict[int, list[Arrival]] = defaultdict(list)
    aborts: dict[int, list[str]] = defaultdict(list)
    for a in arrivals:
        by_step[a.step].append(a)
        if a.abort_at is not None:
            aborts[a.abort_at].append(a.req_id)
    last = max(a.step for a in arrivals)
    for k in range(max_steps):
        trace.step = k
        clock[0] = k
        now[0] = k * STEP_SECONDS
        for a in by_step.get(k, ()):
            sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
            sp.update_from_generation_config({}, None)
            engine.add_request(
                VRequest(
                    request_id=a.req_id,
                    prompt_token_ids=list(a.prompt),
                    sampling_params=sp,
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        for rid in aborts.get(k, ()):  # one by one: finish_requests iterates a set of ids
            if rid in engine.requests:
                engine.finish_requests(rid, status.FINISHED_ABORTED)
        if k > last and not engine.has_requests():
            break
        if k in shape.reset_steps:  # the operator's reset (vLLM's /reset_prefix_cache)
            engine.reset_prefix_cache(reset_connector=True)
        now[0] = (k + 1) * STEP_SECONDS
        so = engine.schedule()
        ids = list(so.num_scheduled_tokens)
        drawn: list[list[int]] = []
        for rid in ids:
            r = engine.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens
            if not done:
                drawn.append([])
            elif given is not None:
                drawn.append([given[rid][r.num_output_tokens]])
            elif shape.counted_tokens:
                drawn.append([100 + r.num_output_tokens])
            else:
                drawn.append([token_rng.randrange(3, 50000)])
        meta = so.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        tr = worker.get_transfer_results(so.finished_req_ids)
        kvo = outputs_mod.KVConnectorOutput(
            finished_sending=tr.finished_sending or None,
            finished_recving=tr.finished_recving or None,
            failed_recving=tr.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        out = outputs_mod.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=drawn,
            kv_connector_output=kvo,
        )
        engine.update_from_output(so, aggregator.aggregate([out], output_rank=0))
    return trace


def summary(trace: Trace) -> dict[str, int]:
    """Counts of the trace's calls by hook (and of preemptions, loads, stores)."""
    out: dict[str, int] = defaultdict(int)
    for calls in trace.calls.values():
        for c in calls:
            out[c[0]] += 1
            if c[0] == "build":
                out["preempted"] += len(c[4])
                out["load_jobs"] += len(c[5])
                out["store_jobs"] += len(c[6])
            if c[0] == "lookup" and c[3][0]:
                out["hits"] += 1
            if c[0] == "output" and c[3]:
                out["invalid"] += 1
    return dict(out)


def steps_alike(a: Trace, b: Trace) -> int:
    """How many leading steps the two traces agree on."""
    n = 0
    for step in sorted(set(a.calls) | set(b.calls)):
        if a.calls.get(step, []) != b.calls.get(step, []):
            break
        n += 1
    return n


__all__: Iterable[str] = [
    "Arrival",
    "Shape",
    "Trace",
    "bench_shape",
    "first_divergence",
    "record",
    "run_bench_model",
    "run_engine_model",
    "run_vllm_engine",
    "steps_alike",
    "summary",
    "workload",
]
