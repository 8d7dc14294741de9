"""The records that cross process boundaries every step (the step's metadata to the workers,
their reports back) survive pickling whole, every field included, and pickle as one
constructor call each."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from statecore.keys import make_offload_key
from statecore.manager import CPULoadStoreSpec
from statecore.wire import (
    ConnectorMetadata,
    DirectionStats,
    GPULoadStoreSpec,
    TransferJob,
    TransferStats,
    WorkerMetadata,
)


def _samples() -> list[Any]:
    gpu = GPULoadStoreSpec((3, 4, 9), (2, 1), (0, 5))
    cpu = CPULoadStoreSpec((7, 8))
    store = TransferJob("req-a", gpu, cpu)
    load = TransferJob("req-b", cpu, gpu)
    key = make_offload_key(b"\x01" * 16, 1)
    meta = ConnectorMetadata(
        load_jobs={4: load},
        store_jobs={5: store},
        jobs_to_flush=frozenset({1, 5}),
        store_keys={5: (key, key)},
        manager_reset=True,
    )
    stats = TransferStats(DirectionStats(10, 0.5, [10]), DirectionStats(20, 0.25, [12, 8]))
    report = WorkerMetadata({5: 1}, {4: 1}, stats, 2, {5: 4}, {4: 4})
    return [gpu, cpu, store, load, meta, stats.load, stats, report]


@pytest.mark.parametrize("obj", _samples(), ids=lambda o: type(o).__name__)
def test_a_record_survives_pickling_with_every_field(obj: Any) -> None:
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(obj, protocol))
        assert type(back) is type(obj)
        assert back == obj
        for f in dataclasses.fields(obj):
            assert getattr(back, f.name) == getattr(obj, f.name), f.name


@pytest.mark.parametrize("obj", _samples(), ids=lambda o: type(o).__name__)
def test_a_record_pickles_as_its_constructor_and_its_fields(obj: Any) -> None:
    cls, args = obj.__reduce__()
    assert cls is type(obj)
    assert args == tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))
