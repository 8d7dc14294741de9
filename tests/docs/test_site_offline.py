"""The built documentation site, opened offline in headless Chromium, shows the lifecycle diagrams.

The site is built with ``mkdocs build --strict`` into a temporary folder and its pages are opened
from ``file://`` URLs in headless Chromium (the Debian package ``chromium``, which
``scripts/test.sh`` installs through ``scripts/_system.sh``) with every network request routed
to a dead proxy and every host name unresolvable. The browser is driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: file descriptors 3 and 4, NUL-terminated JSON),
so nothing beyond the standard library is needed. For each lifecycle page the test asks the
browser for the rendered diagram: an ``<svg>`` with a non-empty box whose state boxes carry
text with a non-empty box inside it, one for every state name of the machine. It also checks
that the page asked for nothing outside the site (no script or font CDN), and saves a
screenshot of each page (to ``$STATECORE_SCREENSHOTS`` when set).

Without Chromium the test skips and says why, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statecore.lifecycle.diagrams import LIFECYCLES

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--allow-file-access-from-files",
    # the network is off: every request goes to a closed local port, no host name resolves
    "--proxy-server=http://127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
    "--host-resolver-rules=MAP * ~NOTFOUND",
)
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    message = (
        "Chromium is not installed, so the offline rendering of the lifecycle diagrams is not "
        "checked (scripts/test.sh installs the Debian package chromium via scripts/_system.sh)"
    )
    if IN_CI:
        pytest.fail(f"CI=true: {message}")
    pytest.skip(message)


def _high_fd(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class DevTools:
    """A minimal DevTools-protocol client over Chromium's debugging pipe."""

    def __init__(self, exe: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # the child's ends move above 9 first, so that moving them to 3 and 4 clobbers neither
        to_browser_r, from_browser_w = (_high_fd(to_browser_r), _high_fd(from_browser_w))
        self.log_path = profile / "chromium.log"
        self._log = self.log_path.open("wb")
        # a tiny launcher puts the two pipe ends on descriptors 3 and 4, then becomes Chromium
        launch = (
            "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
            "os.execv(sys.argv[3], sys.argv[3:])"
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                launch,
                str(to_browser_r),
                str(from_browser_w),
                exe,
                *FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(to_browser_r, from_browser_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def log(self) -> str:
        """The end of Chromium's own log (its stderr)."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-15:] if "dbus" not in line)

    def close(self) -> None:
        """Ask the browser to quit, then make sure it has."""
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.send("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._log.close()

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (status {self.proc.poll()}): {self.log()}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are kept)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        try:
            os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            status = self.proc.poll()
            raise RuntimeError(f"Chromium exited (status {status}): {self.log()}") from None
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout: float = 60) -> dict[str, Any]:
        """The first event ``method`` of ``session`` (already received or still to come)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built with ``mkdocs build --strict``."""
    if shutil.which("mkdocs") is None and not IN_CI:
        pytest.skip("mkdocs is not installed (the docs extra: pip install 'statecore[docs]')")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    exe = _chromium()
    tools = DevTools(exe, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield tools
    finally:
        tools.close()


PROBE = r"""
(() => {
  const svg = document.querySelector('.statecore-diagram svg');
  const pageText = document.body.innerText;
  if (!svg) return {svg: null, raw: pageText.includes('stateDiagram-v2')};
  const r = svg.getBoundingClientRect();
  const inside = b => b.left >= r.left - 1 && b.right <= r.right + 1
    && b.top >= r.top - 1 && b.bottom <= r.bottom + 1;
  const nodes = [...svg.querySelectorAll('g.node')].map(g => {
    const shape = g.querySelector('path, polygon, ellipse');
    const s = shape ? shape.getBoundingClientRect() : null;
    const texts = [...g.querySelectorAll('text')].map(t => {
      const b = t.getBoundingClientRect();
      return {text: t.textContent, w: b.width, h: b.height, inside: inside(b)};
    });
    return {texts, shape: s ? {w: s.width, h: s.height} : null};
  });
  const style = getComputedStyle(svg);
  return {
    svg: {w: r.width, h: r.height, display: style.display, visibility: style.visibility},
    nodes,
    edges: svg.querySelectorAll('g.edge').length,
    raw: pageText.includes('stateDiagram-v2'),
  };
})()
"""


@pytest.mark.parametrize("name", [life.name for life in LIFECYCLES])
def test_lifecycle_page_shows_its_diagram_offline(
    site: Path, browser: DevTools, name: str, tmp_path: Path
) -> None:
    life = next(life for life in LIFECYCLES if life.name == name)
    page = site / "lifecycles" / name / "index.html"
    assert page.is_file(), sorted(p.name for p in (site / "lifecycles").iterdir())

    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"
    ]
    try:
        for domain in ("Page", "Network", "Runtime"):
            browser.send(f"{domain}.enable", session=session)
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        browser.send("Page.navigate", {"url": page.as_uri()}, session=session)
        browser.wait_event("Page.loadEventFired", session)
        found = browser.send(
            "Runtime.evaluate", {"expression": PROBE, "returnByValue": True}, session=session
        )["result"]["value"]
        # scroll the diagram to the top of the viewport and take the screenshot
        browser.send(
            "Runtime.evaluate",
            {
                "expression": "window.scrollTo(0, document.querySelector('.statecore-diagram')"
                ".getBoundingClientRect().top + window.scrollY - 64)"
            },
            session=session,
        )
        shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)
        requests = [
            e["params"]["request"]["url"]
            for e in browser.events
            if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session
        ]
    finally:
        browser.send("Target.closeTarget", {"targetId": target})

    folder = Path(os.environ.get("STATECORE_SCREENSHOTS", str(tmp_path)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"lifecycle-{name}-offline.png").write_bytes(base64.b64decode(shot["data"]))

    assert not found["raw"], "the page shows Mermaid source instead of a diagram"
    svg = found["svg"]
    assert svg is not None, "no diagram (.statecore-diagram svg) on the page"
    assert svg["display"] != "none" and svg["visibility"] == "visible", svg
    assert svg["w"] > 300 and svg["h"] > 150, svg
    shown = set()
    for node in found["nodes"]:
        for text in node["texts"]:
            if text["w"] > 0 and text["h"] > 0 and text["inside"]:
                shown.add(text["text"])
    labels = {str(state.name) for state in life.table.machine.states}
    assert labels <= shown, f"states missing from the rendered diagram: {labels - shown}"
    assert found["edges"] >= len({(t.source, t.target) for t in life.table.transitions})
    external = [url for url in requests if not url.startswith(LOCAL_SCHEMES)]
    assert not external, f"the page asks the network for: {external}"
