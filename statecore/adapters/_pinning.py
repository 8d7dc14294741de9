"""Pinning the CPU pool for the GPU: the CUDA runtime calls the torch adapter makes itself.

Theory of operation. The adapter pins the pool's regions in place (``cudaHostRegister``,
portable + mapped) so a kernel can read and write pool rows directly. Three properties of the
CUDA runtime shape this module:

* A failed runtime call returns its error code *and* leaves it as the calling thread's
  pending error. The next kernel launched on that thread checks for a pending error and
  raises it as its own (torch checks after every launch), so a failed registration that is
  only logged poisons an unrelated later kernel. Every failed call here is therefore followed
  by ``cudaGetLastError`` (which returns and clears the pending error) and reported:
  :attr:`HostRegistration.errors` and a log line name the call, the range and the error.
* One registration of a very large range can fail (recent drivers refuse a single region of
  hundreds of GiB; low host memory fails large ones) and takes about 0.1 s per GB. A region
  is registered in bounded chunks (:attr:`HostRegistration.chunk_bytes`, page-aligned); if any
  chunk fails, every chunk registered so far is unregistered again (rollback), so a failed
  registration leaves nothing pinned. The time and rate are logged and kept.
* A sticky error (a device-side fault) kills the CUDA context: every later call fails. It
  cannot be cleared; :meth:`CudaRuntime.device_synchronize` reveals it, which the adapter
  checks before its self-test so that it neither tests nor falls back on a dead context.

All of this goes through the small :class:`CudaRuntime` interface, each call returning an
error code (0 = success), so tests inject a fake runtime that fails on demand, leaves pending
errors like the real one, and records what is registered (no GPU needed). The real one,
:class:`TorchCudaRuntime`, calls torch's own bindings where torch has them
(``torch.cuda.cudart()``: register, unregister) and the *same* ``libcudart`` that torch
loaded for the rest (found in the process, never loaded a second time: a second copy would
have its own per-thread error state).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CudaCallError",
    "CudaRuntime",
    "HostRegistration",
    "TorchCudaRuntime",
]

log = logging.getLogger("statecore.adapters.torch")

REGISTER_FLAGS = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped
ERROR_NAMES = {
    0: "cudaSuccess",
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    700: "cudaErrorIllegalAddress",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
}
# cudaDevAttrCanUseHostPointerForRegisteredMem: the device addresses registered host memory at
# its host address (so a kernel can be handed host pointers of the mapped pool).
_ATTR_HOST_POINTER = 91
DEFAULT_CHUNK_BYTES = 1 << 30
_HOST_PAGE = 4096


class CudaRuntime(Protocol):
    """The CUDA runtime calls the adapter makes itself; each returns a ``cudaError_t`` code.

    A failed call leaves its code as the thread's pending error, as the real runtime does.
    """

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        """``cudaHostRegister(ptr, size, flags)``."""
        ...

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister(ptr)``."""
        ...

    def get_last_error(self) -> int:
        """``cudaGetLastError()``: the pending error of this thread, which it clears."""
        ...

    def device_synchronize(self) -> int:
        """``cudaDeviceSynchronize()`` on the current device: a sticky error shows here."""
        ...

    def can_use_host_pointer(self, device: int) -> bool | None:
        """Whether ``device`` addresses registered memory at its host address (None: unknown)."""
        ...

    def error_name(self, code: int) -> str:
        """A readable name of ``code``."""
        ...


@dataclass(frozen=True, slots=True)
class CudaCallError:
    """One failed runtime call, as reported: the call, its range, the code, what it cleared.

    Attributes:
        call: the call and its arguments, e.g. ``"cudaHostRegister(0x7f.., 1073741824)"``.
        code: the error code it returned.
        name: the code's name.
        cleared: the pending error ``cudaGetLastError`` returned (and cleared) right after;
            ``-1`` when the runtime could not be asked.
    """

    call: str
    code: int
    name: str
    cleared: int

    def __str__(self) -> str:
        return f"{self.call} -> {self.name} ({self.code}), cleared pending error {self.cleared}"


def checked_call(rt: CudaRuntime, call: str, code: int, errors: list[CudaCallError]) -> bool:
    """Report a runtime call's result: on failure clear the pending error, log, record it.

    Returns whether the call succeeded.
    """
    if code == 0:
        return True
    cleared = rt.get_last_error()
    err = CudaCallError(call, code, rt.error_name(code), cleared)
    errors.append(err)
    log.warning("CUDA call failed: %s", err)
    return False


class HostRegistration:
    """Host ranges registered with CUDA in bounded chunks, all or nothing.

    Args:
        rt: the runtime.
        chunk_bytes: most bytes per ``cudaHostRegister`` call (rounded down to a multiple of
            the host page, at least one page).

    :meth:`register` registers a list of ranges; :meth:`release` unregisters everything this
    object registered. Failed calls are cleared and recorded in :attr:`errors`.
    """

    def __init__(self, rt: CudaRuntime, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.rt = rt
        self.chunk_bytes = max(_HOST_PAGE, chunk_bytes - chunk_bytes % _HOST_PAGE)
        self.chunks: list[tuple[int, int]] = []  # (ptr, size) registered, in order
        self.errors: list[CudaCallError] = []
        self.seconds = 0.0
        self.bytes = 0

    def pieces(self, ptr: int, size: int) -> list[tuple[int, int]]:
        """``(ptr, size)`` of each chunk of a range: chunk ends fall on host pages."""
        out: list[tuple[int, int]] = []
        off = 0
        first = self.chunk_bytes - ptr % _HOST_PAGE  # later chunks start page-aligned
        while off < size:
            n = min(size - off, first if off == 0 else self.chunk_bytes)
            out.append((ptr + off, n))
            off += n
        return out

    def register(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Register every range (chunked). On the first failure, unregister the chunks this
        call registered and return False; nothing of ``ranges`` stays registered."""
        t0 = time.perf_counter()
        start = len(self.chunks)
        total = 0
        for ptr, size in ranges:
            for p, n in self.pieces(ptr, size):
                code = self.rt.host_register(p, n, REGISTER_FLAGS)
                if not checked_call(self.rt, f"cudaHostRegister({p:#x}, {n})", code, self.errors):
                    self._rollback(start)
                    log.warning(
                        "pool registration rolled back after %d of %d bytes", total, _total(ranges)
                    )
                    return False
                self.chunks.append((p, n))
                total += n
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.bytes += total
        if total:
            gb = total / 1e9
            log.info(
                "registered %.2f GB in %d chunks in %.3f s (%.3f s per GB)",
                gb,
                len(self.chunks) - start,
                dt,
                dt / gb,
            )
        return True

    def release(self) -> bool:
        """Unregister every chunk (last first). Returns False if any call failed (reported);
        the chunks the runtime refused to unregister stay in :attr:`chunks`."""
        return self._release_from(0)

    def _rollback(self, start: int) -> None:
        """Unregister the chunks a failed :meth:`register` call had registered."""
        self._release_from(start)

    def _release_from(self, start: int) -> bool:
        refused: list[tuple[int, int]] = []
        for p, n in reversed(self.chunks[start:]):
            code = self.rt.host_unregister(p)
            if not checked_call(self.rt, f"cudaHostUnregister({p:#x})", code, self.errors):
                refused.append((p, n))
        self.chunks[start:] = refused[::-1]
        return not refused


def _total(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(n for _, n in ranges)


def _find_loaded_cudart() -> Any | None:
    """The ``libcudart`` this process already loaded (torch's), or None; never loads one."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart" in ln and "/" in ln}
    except OSError:
        paths = set()
    names = sorted(paths) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    mode = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LAZY", 1)
    for name in names:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    return None


class TorchCudaRuntime:
    """The real runtime: torch's bindings and the ``libcudart`` torch loaded.

    Where that library cannot be found, :meth:`get_last_error` returns ``-1`` (the pending
    error then stays; this is logged once) and :meth:`can_use_host_pointer` asks
    cuda-python, if installed, else answers None.
    """

    def __init__(self) -> None:
        import torch

        cuda: Any = torch.cuda  # partly untyped module
        self._cudart: Any = cuda.cudart()
        self._lib = _find_loaded_cudart()
        if self._lib is None:
            log.warning(
                "libcudart not found in the process: failed CUDA calls cannot be cleared "
                "and may resurface in the next kernel launch"
            )

    @staticmethod
    def _code(res: Any) -> int:
        return int(getattr(res, "value", res))

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        """``cudaHostRegister`` through torch."""
        return self._code(self._cudart.cudaHostRegister(ptr, size, flags))

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister`` through torch."""
        return self._code(self._cudart.cudaHostUnregister(ptr))

    def get_last_error(self) -> int:
        """``cudaGetLastError`` of torch's libcudart; -1 if it was not found."""
        if self._lib is None:
            return -1
        return int(self._lib.cudaGetLastError())

    def device_synchronize(self) -> int:
        """``cudaDeviceSynchronize``; -1 if libcudart was not found (then torch's, raising)."""
        if self._lib is None:
            import torch

            try:
                torch.cuda.synchronize()
            except RuntimeError:
                return -1
            return 0
        return int(self._lib.cudaDeviceSynchronize())

    def can_use_host_pointer(self, device: int) -> bool | None:
        """``cudaDevAttrCanUseHostPointerForRegisteredMem`` of ``device``."""
        if self._lib is not None:
            value = ctypes.c_int(0)
            code = int(
                self._lib.cudaDeviceGetAttribute(ctypes.byref(value), _ATTR_HOST_POINTER, device)
            )
            if code == 0:
                return bool(value.value)
            self.get_last_error()
            return None
        try:
            from cuda.bindings import runtime as crt  # type: ignore[import-not-found,unused-ignore]

            err, v = crt.cudaDeviceGetAttribute(
                crt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem, device
            )
            return bool(v) if int(getattr(err, "value", err)) == 0 else None
        except Exception:
            return None

    def error_name(self, code: int) -> str:
        """The runtime's name for ``code`` (a table of the usual ones without libcudart)."""
        if self._lib is not None and code >= 0:
            fn = self._lib.cudaGetErrorName
            fn.restype = ctypes.c_char_p
            name = fn(code)
            if name:
                return str(name.decode())
        return ERROR_NAMES.get(code, f"cudaError {code}")
