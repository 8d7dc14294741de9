"""Seeded mutants of the CUDA registration path; the fault-injection verifier must catch each.

Each mutant brings back, with ``monkeypatch``, one bug of the class the registration code
guards against (the pending error of a failed call left for the next kernel, no rollback of
a partly registered pool, a whole region in one call, unregistration codes ignored). The
verifier is :func:`scenario`: backends over a fake CUDA runtime (a failing chunk, a double
registration, a refused unregistration, rebuild after shutdown) checked by
``cuda_fakes.findings``. Without a mutant it finds nothing; with any, it finds something.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch adapter needs torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker"))

from cuda_fakes import FakeCudaRuntime, findings

import statecore.adapters._pinning as pinning
from statecore.adapters.torch import TorchTransferBackend
from statecore.pool import CPUPool

CHUNK = 4096


def _backend(rt: FakeCudaRuntime, pool: CPUPool | None = None) -> TorchTransferBackend:
    import torch

    caches = [torch.zeros((8, 256), dtype=torch.uint8), torch.zeros((8, 128), dtype=torch.uint8)]
    pool = pool if pool is not None else CPUPool(48, [256, 128])
    return TorchTransferBackend(
        caches,
        pool,
        1,
        threads=1,
        copy_impl="staging",
        cuda_runtime=rt,
        register_chunk_bytes=CHUNK,
        staging_chunk_bytes=2 * CHUNK,
        staging_chunks=2,
    )


def scenario() -> list[str]:
    """Everything the verifier finds over one run of the registration scenarios."""
    found: list[str] = []
    # a chunk fails (host memory): rollback, cleared, reported
    rt = FakeCudaRuntime(fail_register=lambda call, ptr, size: 2 if call == 3 else 0)
    a = _backend(rt)
    found += findings(rt, a)
    a.shutdown()
    found += findings(rt, a, after_shutdown=True)
    # double registration, then rebuilding on the same pool after shutdown
    rt = FakeCudaRuntime()
    b = _backend(rt)
    c = _backend(rt, b.pool)
    found += findings(rt, b, c)
    b.shutdown()
    c.shutdown()
    found += findings(rt, b, c, after_shutdown=True)
    d = _backend(rt, b.pool)
    if not d.pool_registered:
        found.append("rebuilt backend could not register the pool")
    d.shutdown()
    found += findings(rt, b, c, d, after_shutdown=True)
    # the runtime refuses one unregistration: cleared, reported, the rest released
    refused: list[int] = []
    rt = FakeCudaRuntime(fail_unregister=lambda ptr: 1 if ptr in refused else 0)
    e = _backend(rt)
    refused.append(sorted(rt.registered)[0])
    e.shutdown()
    found += findings(rt, e)
    if list(rt.registered) != refused:
        found.append(f"{len(rt.registered)} chunks left, expected only the refused one")
    return found


def _no_clear(rt: Any, call: str, code: int, errors: list[Any]) -> bool:
    if code == 0:
        return True
    errors.append(pinning.CudaCallError(call, code, rt.error_name(code), -1))
    return False  # the pending error is left for the next kernel


def _ignore_unregister_codes(self: Any, start: int) -> bool:
    while len(self.chunks) > start:
        p, _ = self.chunks.pop()
        self.rt.host_unregister(p)  # return code dropped, as before the fix
    return True


MUTANTS: dict[str, tuple[Any, str, Callable[..., Any]]] = {
    "pending error not cleared": (pinning, "checked_call", _no_clear),
    "no rollback of a partial registration": (
        pinning.HostRegistration,
        "_rollback",
        lambda self, start: None,
    ),
    "whole region in one call": (
        pinning.HostRegistration,
        "pieces",
        lambda self, ptr, size: [(ptr, size)],
    ),
    "unregister codes ignored": (
        pinning.HostRegistration,
        "_release_from",
        _ignore_unregister_codes,
    ),
}


def test_verifier_passes_without_mutants() -> None:
    assert scenario() == []


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_cuda_mutant_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target, attr, replacement = MUTANTS[name]
    monkeypatch.setattr(target, attr, replacement)
    assert scenario() != [], f"mutant survived: {name}"
