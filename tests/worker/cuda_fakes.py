"""A fake CUDA runtime for the torch adapter's registration seam, and the checks over it.

:class:`FakeCudaRuntime` models what matters of the real one: which host ranges are
registered (overlaps are refused with ``cudaErrorHostMemoryAlreadyRegistered``, unknown
pointers with ``cudaErrorHostMemoryNotRegistered``), the calling thread's *pending error*
that a failed call leaves behind and ``cudaGetLastError`` clears, and a sticky error (a dead
context) that ``cudaDeviceSynchronize`` reports. Failures are injected by call number or by
range. :meth:`FakeCudaRuntime.launch` is what torch does after a kernel launch: raise the
pending error as the kernel's own.

:func:`findings` is the verifier the tests (and the seeded mutants) use: everything a backend
over this runtime must never leave behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from statecore.adapters._pinning import ERROR_NAMES

ALREADY_REGISTERED = 712
NOT_REGISTERED = 713
OUT_OF_MEMORY = 2
ILLEGAL_ADDRESS = 700


class FakeCudaRuntime:
    """Registration state and the pending error of one thread, with injectable failures.

    Args:
        fail_register: ``(call number from 1, ptr, size) -> error code or 0``.
        fail_unregister: ``(ptr) -> error code or 0`` (the range stays registered on failure).
        host_pointer: the answer to ``can_use_host_pointer``.
        sticky: a sticky error code (a dead context), 0 for none.
    """

    def __init__(
        self,
        fail_register: Callable[[int, int, int], int] | None = None,
        fail_unregister: Callable[[int], int] | None = None,
        host_pointer: bool | None = True,
        sticky: int = 0,
    ) -> None:
        self.fail_register = fail_register
        self.fail_unregister = fail_unregister
        self.host_pointer = host_pointer
        self.sticky = sticky
        self.registered: dict[int, int] = {}  # ptr -> size
        self.pending = 0
        self.register_calls = 0
        self.max_registered_size = 0
        self.log: list[tuple[str, int, int]] = []  # (call, ptr, code)

    def _fail(self, code: int) -> int:
        self.pending = code
        return code

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        self.register_calls += 1
        code = self.fail_register(self.register_calls, ptr, size) if self.fail_register else 0
        if not code and any(p < ptr + size and ptr < p + n for p, n in self.registered.items()):
            code = ALREADY_REGISTERED
        self.log.append(("register", ptr, code))
        if code:
            return self._fail(code)
        self.registered[ptr] = size
        self.max_registered_size = max(self.max_registered_size, size)
        return 0

    def host_unregister(self, ptr: int) -> int:
        code = self.fail_unregister(ptr) if self.fail_unregister else 0
        if not code and ptr not in self.registered:
            code = NOT_REGISTERED
        self.log.append(("unregister", ptr, code))
        if code:
            return self._fail(code)
        del self.registered[ptr]
        return 0

    def get_last_error(self) -> int:
        code, self.pending = self.pending, 0
        return code

    def device_synchronize(self) -> int:
        return self.sticky

    def can_use_host_pointer(self, device: int) -> bool | None:
        return self.host_pointer

    def error_name(self, code: int) -> str:
        return ERROR_NAMES.get(code, f"cudaError {code}")

    def launch(self) -> None:
        """What torch does right after a kernel launch: a pending error becomes its error."""
        if self.pending:
            code, self.pending = self.pending, 0
            raise RuntimeError(f"CUDA error: {self.error_name(code)} (raised by a later kernel)")

    def overlapping(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """Registered pointers that overlap any of ``ranges``."""
        return [p for p, n in self.registered.items() for a, m in ranges if p < a + m and a < p + n]


def pool_ranges(be: Any) -> list[tuple[int, int]]:
    """The host ranges of a backend's pool regions."""
    return [(c.data_ptr(), c.numel()) for c in be._cpu if c.numel()]


def findings(rt: FakeCudaRuntime, *backends: Any, after_shutdown: bool = False) -> list[str]:
    """What backends over ``rt`` left wrong; empty when all is well.

    * a pending error (the next kernel on the thread would raise it);
    * a pool registered although its backend says it is not (no rollback), or registered
      after ``shutdown``;
    * a failed call (in ``rt.log``) that no backend reported in ``cuda_errors``;
    * a single registration larger than the backend's chunk bound.
    """
    out: list[str] = []
    if rt.pending:
        out.append(f"pending CUDA error {rt.pending} left for the next kernel")
    owned = {  # chunks a backend that says its pool is registered holds
        ptr
        for be in backends
        if be.pool_registered and not after_shutdown and be.registration is not None
        for ptr, _ in be.registration.chunks
    }
    pools = [r for be in backends for r in pool_ranges(be)]
    left = sorted(set(rt.overlapping(pools)) - owned)
    if left:
        out.append(f"{len(left)} pool chunks registered by no registered backend")
    for be in backends:
        reg = be.registration
        if reg is not None and rt.max_registered_size > reg.chunk_bytes:
            out.append(f"a registration of {rt.max_registered_size} B > chunk {reg.chunk_bytes} B")
    failed = sum(1 for _, _, code in rt.log if code)
    reported = sum(len(be.cuda_errors) for be in backends)
    if failed > reported:
        out.append(f"{failed} failed CUDA calls, {reported} reported")
    return out


class Backends:
    """Every backend a test builds; :meth:`close_all` shuts each down (last built first).

    A CUDA backend registers its pool with the driver until ``shutdown``; a test that fails
    between construction and its own ``shutdown`` would otherwise leave the registration
    behind, and the next test building a backend over reused memory would be refused with
    "already registered".
    """

    def __init__(self) -> None:
        self.made: list[Any] = []

    def add(self, backend: Any) -> Any:
        """Track ``backend`` (returned, for chaining)."""
        self.made.append(backend)
        return backend

    def close_all(self) -> None:
        """Shut every tracked backend down; re-raise the first failure after trying all."""
        errors: list[BaseException] = []
        while self.made:
            try:
                self.made.pop().shutdown()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
