"""Run a workload through a real vLLM engine (the CPU build) with or without statecore.

A *workload* is a list of rounds; a round is a list of prompts (token ids) submitted together
(one ``LLM.generate`` call, so they are scheduled as one batch, as far as the engine's budget
allows). Every run uses greedy sampling with the sampled token's logprob, and returns, per
prompt, the generated token ids and their logprobs, plus what statecore did (tokens it loaded
into the device cache, counted from the bytes its workers copied; its counters).

The model is written by :func:`write_model`: a tiny ``LlamaForCausalLM`` (random weights from
the seed, ``load_format="dummy"``; no tokenizer), optionally with sliding-window layers next
to full-attention ones (``layer_types``), which vLLM serves as two KV-cache groups.

:func:`run_engine` runs in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
``python -m statecore.bench.e2e_harness SPEC.json OUT.json`` runs the same thing in a process of
its own (the file-tier restart and the shared Redis scenarios);
``python -m statecore.bench.e2e_harness write-model DIR`` writes the model directory (for a
server started by hand, docs/guides/vllm.md). The end-to-end suite
(``tests/e2e``) and ``statecore bench e2e`` share it; it needs vLLM (imported lazily).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK_SIZE = 32
"""Tokens per device block (the CPU attention backend wants a multiple of 32)."""

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_model(
    directory: Path,
    *,
    sliding_window: int | None = None,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
) -> Path:
    """Write a tiny Llama ``config.json`` into ``directory`` and return it. With
    ``sliding_window``, even layers attend to that many tokens (``layer_types``), odd layers
    to everything."""
    cfg: dict[str, Any] = dict(LLAMA)
    cfg.update(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
    )
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


@dataclass
class EngineSpec:
    """One engine run.

    Attributes:
        model: the model directory (:func:`write_model`).
        rounds: prompts (token ids) per round; a round is one ``generate`` call.
        max_tokens: tokens generated per prompt.
        gpu_blocks: device blocks (``num_gpu_blocks_override``).
        connector: statecore's ``kv_connector_extra_config``; None runs without a connector.
        max_model_len, max_num_seqs, max_num_batched_tokens: the engine's limits.
        seed: the engine's seed (the dummy weights).
        reset_at: ``[round, step]`` pairs: reset the prefix cache (vLLM's and the
            connector's, running requests preempted) after that engine step of that round.
        abort: per round, the number of engine steps after which the round's odd-numbered
            requests are aborted (None: never); aborted requests' outputs are not compared.
        inject: fault to inject into the statecore worker: ``"load_failure"`` (the first load
            job fails on the worker) or None.
        kv_events: enable vLLM's KV-cache events (collected from the connector).
        kv_load_failure_policy: vLLM's policy for a failed load: ``"fail"`` (its default:
            the request ends with an error) or ``"recompute"``.
        log_stats: turn vLLM's stats logging on (``disable_log_stats=False``): its
            Prometheus logger then records the connector's stats in this process's default
            registry (:attr:`RunResult.metrics`).
        async_scheduling: vLLM's asynchronous scheduling (the next step is scheduled while
            the current one runs).
    """

    model: str
    rounds: list[list[list[int]]]
    max_tokens: int = 8
    gpu_blocks: int = 64
    connector: dict[str, Any] | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    seed: int = 0
    reset_at: list[list[int]] = field(default_factory=list)
    abort: list[int | None] | None = None
    inject: str | None = None
    kv_events: bool = False
    kv_load_failure_policy: str = "fail"
    log_stats: bool = False
    async_scheduling: bool = False


@dataclass
class RunResult:
    """What one engine run produced.

    Attributes:
        outputs: per round, per prompt, (token ids, logprobs of those tokens); None for an
            aborted request.
        loaded_tokens: tokens statecore copied into the device cache (its workers' load
            bytes over the KV bytes of one token); 0 without a connector.
        stored_tokens: the same for stores.
        counters: statecore's scheduler counters at the end (summed over the run).
        loaded_by_round: loaded tokens after each round.
        events: KV events the connector published (type names), when ``kv_events``.
        num_groups: KV-cache groups of the engine.
        injected: faults injected (``EngineSpec.inject``).
        stats: every ``get_stats`` delta of the run summed (the scheduler's and the
            manager's, its tiers' included).
        final: the scheduler's jobs, tracked requests and stalled ledger at the end.
        metrics: with ``log_stats``, the connector's Prometheus metrics as vLLM recorded them
            (:func:`prometheus_samples`: counters as ``NAME_total``, gauges as ``NAME``, each
            summed over its labels).
    """

    outputs: list[list[tuple[list[int], list[float]] | None]]
    loaded_tokens: int = 0
    stored_tokens: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    loaded_by_round: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    num_groups: int = 0
    injected: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def prometheus_samples() -> dict[str, float]:
    """The connector's metrics in this process's default Prometheus registry (the one vLLM's
    logger uses): every counter (``NAME_total``) and gauge (``NAME``) of
    :func:`statecore.adapters.vllm_metrics.metric_names`, summed over its labels."""
    from prometheus_client import REGISTRY

    from statecore.adapters.vllm_metrics import metric_names

    names = metric_names()
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name not in names or family.type not in ("counter", "gauge"):
            continue
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def _connector_config(extra: dict[str, Any], load_failure_policy: str) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="StatecoreOffloadingConnector",
        kv_connector_module_path="statecore.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy=load_failure_policy,
    )


def make_llm(spec: EngineSpec) -> Any:
    """The engine ``spec`` describes (``vllm.LLM``, in this process)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if spec.connector is not None:
        kwargs["kv_transfer_config"] = _connector_config(
            spec.connector, spec.kv_load_failure_policy
        )
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if spec.async_scheduling:
        kwargs["async_scheduling"] = True
    return LLM(
        model=spec.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=spec.gpu_blocks,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=spec.seed,
        disable_log_stats=not spec.log_stats,
        **kwargs,
    )


def engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of ``llm``."""
    return llm.llm_engine.engine_core.engine_core


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role connector, worker-role connector) of an in-process engine."""
    core = engine_core(llm)
    sched = core.scheduler.connector
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return sched, get_kv_transfer_group()


def token_bytes(llm: Any) -> int:
    """KV bytes of one token over every layer of every group."""
    cfg = engine_core(llm).scheduler.kv_cache_config
    total = 0
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        total += int(spec.page_size_bytes) * len(g.layer_names) // int(spec.block_size)
    return total


def shutdown(llm: Any) -> None:
    """Shut the engine down and release what it holds (another engine may follow)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
    )


def _collect(out: Any) -> tuple[list[int], list[float]]:
    comp = out.outputs[0]
    ids = list(comp.token_ids)
    lps = [float(step[t].logprob) for step, t in zip(comp.logprobs, ids, strict=True)]
    return ids, lps


def run_round(
    llm: Any,
    prompts: Sequence[list[int]],
    max_tokens: int,
    abort_after: int | None,
    reset_after: Sequence[int] = (),
) -> list[tuple[list[int], list[float]] | None]:
    """One round through the engine's own loop, so that requests can be aborted mid-run."""
    engine = llm.llm_engine
    params = _sampling(max_tokens)
    ids = []
    base = next(llm.request_counter)
    for i, p in enumerate(prompts):
        rid = f"r{base}-{i}"
        engine.add_request(rid, {"prompt_token_ids": list(p)}, params)
        ids.append(rid)
    done: dict[str, Any] = {}
    core = engine_core(llm)
    steps = 0
    aborted: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if abort_after is not None and steps == abort_after:
            aborted = {rid for i, rid in enumerate(ids) if i % 2 == 1 and rid not in done}
            engine.abort_request(list(aborted))
        if reset_after and steps >= reset_after[0] and not _loading(core):
            # vLLM refuses a reset while a request waits for its load (it raises after
            # preempting everything), so the reset waits for a step without one
            ok = engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            if not ok:
                raise RuntimeError(f"reset_prefix_cache after step {steps} failed")
            reset_after = reset_after[1:]
    if reset_after:
        raise RuntimeError(f"the round ended before its reset after step {reset_after[0]}")
    # as a server's busy loop does: step while the core has work (finished requests to
    # signal, the connector's jobs in flight), so a round's final stores are built and done
    for _ in range(10_000):
        if not core.scheduler.has_requests():
            break
        engine.step()
    else:
        raise RuntimeError("the engine core kept pending work for 10,000 idle steps")
    return [None if rid in aborted else _collect(done[rid]) for rid in ids]


def _loading(core: Any) -> bool:
    """Whether a request of the engine core waits for its KV load."""
    from vllm.v1.request import RequestStatus

    return any(
        r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in core.scheduler.requests.values()
    )


def _inject(llm: Any, fault: str) -> dict[str, int]:
    """Fault injection into the statecore worker of an in-process engine.

    ``"load_failure"``: the backend refuses the first load job it is given (``submit``
    raises, which the worker reports as a failed job); the scheduler then hands its blocks
    back to vLLM as load errors and vLLM recomputes them. Returns a counter of injections.
    """
    if fault != "load_failure":
        raise ValueError(f"unknown fault {fault!r}")
    _, worker_conn = connectors(llm)
    backend = worker_conn.worker._backend
    submit = backend.submit
    fired = {"load_failure": 0}

    def failing_submit(job_id: int, job: Any, is_store: bool) -> None:
        if not is_store and fired["load_failure"] == 0:
            fired["load_failure"] += 1
            raise OSError("injected: the first load job fails")
        submit(job_id, job, is_store)

    backend.submit = failing_submit
    return fired


def _accumulate_stats(scheduler: Any, into: dict[str, float]) -> None:
    """Sum every ``get_stats`` delta ``scheduler`` hands out (to vLLM's stats logger or to
    this harness) into ``into``."""
    get_stats = scheduler.get_stats

    def counted() -> dict[str, Any]:
        delta: dict[str, Any] = get_stats()
        for k, v in delta.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                into[k] = into.get(k, 0) + v
        return delta

    scheduler.get_stats = counted


def _record_events(conn: Any, into: list[str]) -> None:
    """Record the type of every KV event the connector hands vLLM's publisher."""
    take = conn.take_events

    def recorded() -> Any:
        events = list(take())
        into.extend(type(e).__name__ for e in events)
        return events

    conn.take_events = recorded


def run_engine(spec: EngineSpec, on_round: Callable[[Any, int], None] | None = None) -> RunResult:
    """Run ``spec`` in this process and return what it produced."""
    llm = make_llm(spec)
    try:
        sched_conn = None
        per_token = 0
        stats: dict[str, float] = {}
        res = RunResult(outputs=[])
        if spec.connector is not None:
            sched_conn, _ = connectors(llm)
            per_token = token_bytes(llm)
            _accumulate_stats(sched_conn.scheduler, stats)
            if spec.kv_events:
                _record_events(sched_conn, res.events)
        injected = _inject(llm, spec.inject) if spec.inject is not None else {}
        totals: dict[str, float] = {}
        res.num_groups = len(engine_core(llm).scheduler.kv_cache_config.kv_cache_groups)

        def take() -> None:
            # the scheduler's cumulative counters (get_stats() is a delta vLLM's stats
            # logger already consumes every step)
            if sched_conn is None:
                return
            totals.clear()
            for k, v in sched_conn.scheduler.counters.as_dict().items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    totals[k] = v

        for r, prompts in enumerate(spec.rounds):
            abort_after = spec.abort[r] if spec.abort else None
            resets = [step for rr, step in spec.reset_at if rr == r]
            res.outputs.append(run_round(llm, prompts, spec.max_tokens, abort_after, resets))
            take()
            if per_token:
                res.loaded_by_round.append(int(totals.get("load_bytes", 0)) // per_token)
            if on_round is not None:
                on_round(llm, r)
        take()
        if sched_conn is not None:
            last = sched_conn.scheduler.get_stats()  # the rest, into ``stats``
            res.final = {k: last[k] for k in ("live_jobs", "tracked_requests", "stalled_ledger")}
        res.stats = stats
        res.counters = totals
        if spec.log_stats and sched_conn is not None:
            res.metrics = prometheus_samples()
        res.injected = sum(injected.values())
        if per_token:
            res.loaded_tokens = int(totals.get("load_bytes", 0)) // per_token
            res.stored_tokens = int(totals.get("store_bytes", 0)) // per_token
        return res
    finally:
        shutdown(llm)


USAGE = """\
usage: python -m statecore.bench.e2e_harness SPEC.json OUT.json
       python -m statecore.bench.e2e_harness write-model DIR [--sliding-window N] [--layers N]

SPEC.json OUT.json: run the EngineSpec in SPEC.json, write its RunResult to OUT.json.
write-model DIR: write the tiny Llama config.json the suite serves into DIR (no weights:
serve it with --load-format dummy --skip-tokenizer-init)."""


def _write_model_cli(argv: Sequence[str]) -> int:
    """``write-model DIR [--sliding-window N] [--layers N]``."""
    args = list(argv)
    opts: dict[str, int] = {}
    directory: str | None = None
    while args:
        arg = args.pop(0)
        if arg in ("--sliding-window", "--layers") and args and args[0].isdigit():
            opts[arg[2:].replace("-", "_")] = int(args.pop(0))
        elif not arg.startswith("-") and directory is None:
            directory = arg
        else:
            print(f"write-model: unexpected argument {arg!r}\n{USAGE}", file=sys.stderr)
            return 2
    if directory is None:
        print(f"write-model: DIR is missing\n{USAGE}", file=sys.stderr)
        return 2
    print(write_model(Path(directory), **opts))
    return 0


def main(argv: Sequence[str]) -> int:
    """``python -m statecore.bench.e2e_harness SPEC.json OUT.json``: one run in its own
    process; ``... write-model DIR``: write the model directory (:data:`USAGE`)."""
    if argv and argv[0] == "write-model":
        return _write_model_cli(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    spec = EngineSpec(**json.loads(Path(argv[0]).read_text()))
    res = run_engine(spec)
    Path(argv[1]).write_text(json.dumps(asdict(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
