"""``vramguard report`` in a real headless browser (Debian's ``chromium``; ``.ci/run`` installs it).

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: fd 3 in,
fd 4 out, NUL-terminated JSON), so no browser-driver package is needed. Checked: the page loads
with no console message of level error or warning, no exception and no request other than the page
itself; every plot is present and non-blank in a screenshot; a regression injected into a copy of
the store is marked in the plot and named with its release, and the original store's report has none.
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_trend_report import MiB, doc

from vramguard.cli import main
from vramguard.history.store import ResultStore

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# .ci/run installs chromium and sets VRAMGUARD_REQUIRE_CHROMIUM=1: there a missing browser fails, never skips
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("VRAMGUARD_REQUIRE_CHROMIUM") != "1",
    reason="chromium is not installed (.ci/run installs it)",
)


class Browser:
    """A headless chromium and one page, over the DevTools pipe."""

    def __init__(self, profile: Path) -> None:
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()
        flags = [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", f"--user-data-dir={profile}",
            "--no-first-run", "--no-default-browser-check", "--disable-background-networking", "--disable-sync",
            "--disable-component-update", "--disable-extensions", "--window-size=1300,900", "about:blank",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', CHROMIUM, *flags],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read(deadline - time.monotonic()))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._in)
        os.close(self._out)


@pytest.fixture
def browser(tmp_path: Path):
    b = Browser(tmp_path / "profile")
    try:
        yield b
    finally:
        b.close()


def load(browser: Browser, page: Path) -> dict[str, Any]:
    """Open ``page``; what it logged and requested, and the plots' boxes."""
    browser.events.clear()
    url = page.absolute().as_uri()
    browser.call("Page.navigate", session=True, url=url)
    browser.wait_for("Page.loadEventFired")
    time.sleep(0.5)  # late console messages
    browser.call("Runtime.evaluate", session=True, expression="1")  # drain events that arrived meanwhile
    ev = browser.events
    console = [e["params"] for e in ev if e.get("method") == "Runtime.consoleAPICalled"]
    logs = [e["params"]["entry"] for e in ev if e.get("method") == "Log.entryAdded"]
    return {
        "url": url,
        "requests": [
            e["params"]["request"]["url"] for e in ev if e.get("method") == "Network.requestWillBeSent"
        ],
        "problems": [c for c in console if c["type"] in ("error", "warning", "assert")]
        + [entry for entry in logs if entry["level"] in ("error", "warning")]
        + [e["params"] for e in ev if e.get("method") == "Runtime.exceptionThrown"],
        "plots": browser.evaluate(
            "[...document.querySelectorAll('figure.plot')].map(f => {const r = f.getBoundingClientRect();"
            " return {x: r.x + scrollX, y: r.y + scrollY, w: r.width, h: r.height,"
            " svg: f.querySelectorAll('svg').length}})"
        ),
        "marked": browser.evaluate("[...document.querySelectorAll('svg [id^=regression]')].map(e => e.id)"),
        "named": browser.evaluate("[...document.querySelectorAll('li.regression')].map(e => e.textContent)"),
    }


def ink(browser: Browser, box: dict[str, float]) -> float:
    """Share of the box's screenshot pixels that are not white."""
    from PIL import Image

    shot = browser.call(
        "Page.captureScreenshot",
        session=True,
        format="png",
        captureBeyondViewport=True,
        clip={"x": box["x"], "y": box["y"], "width": box["w"], "height": box["h"], "scale": 1},
    )
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("L")
    histogram = image.histogram()
    return sum(histogram[:200]) / sum(histogram)


def test_report_loads_clean_with_every_plot_drawn_and_an_injected_regression_marked(
    browser: Browser, tmp_path: Path
) -> None:
    layers = {f"model.layers.{i}": {"activation": 4 * MiB, "weight-copy": (i % 2) * MiB} for i in range(4)}
    store = ResultStore(tmp_path / "store")
    for version in ("0.48.0", "0.49.0", "0.49.1"):
        store.add(doc(version, 100 * MiB, layers=layers))
    injected = tmp_path / "injected"
    shutil.copytree(store.root, injected)
    ResultStore(injected).add(doc("0.50.0", 140 * MiB, layers=layers))

    clean_html, bad_html = tmp_path / "clean.html", tmp_path / "bad.html"
    assert main(["report", str(store.root), "-o", str(clean_html)]) == 0
    assert main(["report", str(injected), "-o", str(bad_html)]) == 0

    clean = load(browser, clean_html)
    assert clean["problems"] == []
    assert set(clean["requests"]) <= {clean["url"]}, clean["requests"]
    assert len(clean["plots"]) == 3 and all(
        p["svg"] == 1 and p["w"] > 100 and p["h"] > 100 for p in clean["plots"]
    )
    for box in clean["plots"]:
        assert ink(browser, box) > 0.01, box  # drawn, not a blank box
    assert clean["marked"] == [] and clean["named"] == []

    bad = load(browser, bad_html)
    assert bad["problems"] == [] and set(bad["requests"]) <= {bad["url"]}
    assert len(bad["marked"]) == 1
    (named,) = bad["named"]
    assert "peak_allocated" in named and "bitsandbytes 0.50.0" in named and "0.49.1 -> 0.50.0" in named
    # the marker is drawn: the regression plot has more red than the clean one
    shot = browser.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)
    (tmp_path / "bad.png").write_bytes(base64.b64decode(shot["data"]))
    assert all(ink(browser, box) > 0.01 for box in bad["plots"])


def test_the_checks_see_requests_console_errors_and_blank_plots(browser: Browser, tmp_path: Path) -> None:
    """The harness itself: each check above can fail."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><body><img src='http://198.51.100.1/x.png'>"
        "<script>console.error('boom')</script><figure class='plot' style='width:300px;height:200px'>"
        "<svg width='300' height='200'></svg></figure></body></html>"
    )
    seen = load(browser, page)
    assert "http://198.51.100.1/x.png" in seen["requests"]
    assert any(p.get("type") == "error" for p in seen["problems"])
    (box,) = seen["plots"]
    assert ink(browser, box) == 0.0
