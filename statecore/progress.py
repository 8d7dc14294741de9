"""Progress of long commands on stderr: a line redrawn in place on a terminal, a heartbeat
line every few seconds otherwise (a log file, CI).

The project depends on neither Rich nor tqdm, so this is a few lines of its own. Commands
create a :class:`Progress` and call :meth:`Progress.update`; library code never prints and
takes a callback instead (e.g. ``on_round`` of :func:`statecore.sim.multi.run_instances`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Heartbeat", "Progress"]


class Progress:
    """One long task's progress on ``stream`` (stderr by default).

    Args:
        label: what is running (first on every line).
        total: the amount of work, if known (shown as ``done/total``).
        unit: the unit of ``done`` (``"steps"``, ``"examples"``).
        stream: where to write (default ``sys.stderr``).
        interval_s: seconds between heartbeat lines when ``stream`` is not a terminal.
        enabled: ``False`` writes nothing (``--no-progress``, ``--json`` on a terminal).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "",
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = sys.stderr if stream is None else stream
        self.interval_s = interval_s
        self.enabled = enabled
        self.clock = clock
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.start = clock()
        self._next = self.start + (0.0 if self.tty else interval_s)
        self._width = 0

    def _text(self, done: int, note: str) -> str:
        amount = f"{done}/{self.total}" if self.total else f"{done}"
        unit = f" {self.unit}" if self.unit else ""
        elapsed = self.clock() - self.start
        extra = f", {note}" if note else ""
        return f"{self.label}: {amount}{unit}, {elapsed:.0f} s{extra}"

    def update(self, done: int, note: str = "") -> None:
        """``done`` units of work are done (``note``: a few words on what is going on)."""
        if not self.enabled:
            return
        now = self.clock()
        if now < self._next:
            return
        text = self._text(done, note)
        if self.tty:
            self._next = now + 0.2
            pad = " " * max(0, self._width - len(text))
            self._width = len(text)
            self.stream.write("\r" + text + pad)
        else:
            self._next = now + self.interval_s
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Clear the terminal line (a heartbeat's lines stay)."""
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Heartbeat:
    """A line on ``stream`` every ``interval_s`` seconds while a block runs, from a thread
    (for commands whose work has no natural place to report from, e.g. the benchmarks; the
    thread sleeps in between, so it does not disturb what they measure).

    Args:
        label: what is running.
        interval_s: seconds between lines (the first after one interval).
        stream: where to write (default ``sys.stderr``).
    """

    def __init__(self, label: str, interval_s: float = 10.0, stream: TextIO | None = None) -> None:
        import threading

        self.label = label
        self.interval_s = interval_s
        self.stream = sys.stderr if stream is None else stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="statecore-heartbeat", daemon=True)
        self._start = time.monotonic()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            elapsed = time.monotonic() - self._start
            try:
                self.stream.write(f"{self.label}: still running, {elapsed:.0f} s\n")
                self.stream.flush()
            except (OSError, ValueError):  # stderr closed: stop quietly
                return

    def __enter__(self) -> Heartbeat:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
