"""A real headless Chromium (Debian's, through its chromedriver) for the dashboard tests.

Screenshots go to ``$PHASEWATCH_ARTIFACTS`` (default ``test-artifacts/`` at the
repository root), kept after the run as the tests' artefacts.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from tests.conftest import require_binary
from tests.support import ROOT

ARTIFACTS = Path(os.environ.get("PHASEWATCH_ARTIFACTS",
                                ROOT / "test-artifacts"))
# Without the background-networking flags Chromium keeps calling Google's hosts,
# which this closed network refuses (and a run can stall on).
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,2200")


class Browser:
    def __init__(self):
        binary = require_binary("chromium", "the dashboard tests run in a real browser")
        driver = require_binary("chromedriver", "Selenium drives chromium through it")
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        self._profile = tempfile.TemporaryDirectory(prefix="pw-chromium-")
        options = Options()
        options.binary_location = binary
        for flag in (*FLAGS, f"--user-data-dir={self._profile.name}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.driver.set_page_load_timeout(30)
        self.console: list[dict] = []

    def close(self) -> None:
        self.driver.quit()
        self._profile.cleanup()

    def open(self, url: str) -> None:
        self.driver.get(url)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
            except Exception as e:  # the page may be mid-render; keep polling
                last = e
            else:
                if last:
                    return last
            time.sleep(0.5)
        self.screenshot(f"timeout-{what.replace(' ', '-')}")
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: "
                             f"{last!r}")

    def console_errors(self) -> list[dict]:
        """Browser console entries at SEVERE level since the last call (kept in .console)."""
        entries = self.driver.get_log("browser")
        self.console.extend(entries)
        return [e for e in entries if e["level"] == "SEVERE"]

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"dashboard-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def viewport(self, width: int, height: int = 1000) -> None:
        """Lay the page out ``width`` CSS pixels wide (``height`` tall), exactly: a
        window's size would include the scroll bar and the window's frame."""
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def full_page(self, name: str, width: int) -> Path:
        """A screenshot of the whole page at ``width`` (the viewport stretched to the
        page's height, so every panel is in it)."""
        self.viewport(width)
        height = self.js("return document.documentElement.scrollHeight")
        self.viewport(width, int(height))
        try:
            return self.screenshot(name)
        finally:
            self.viewport(width)

    def boxes(self, css: str) -> list[dict]:
        """The bounding boxes (left, top, right, bottom, in CSS pixels) of every element
        ``css`` selects, with its id (or its closest ancestor's with one)."""
        return self.layout(css)[css]

    def layout(self, *css: str) -> dict[str, list[dict]]:
        """``boxes`` for each selector, all read in one script, so no reflow between two
        reads (the demo's verdict text rewrapping above the grid) shifts one against the
        other."""
        return self.js("return Object.fromEntries(arguments[0].map(c => [c, "
                       "Array.from(document.querySelectorAll(c)).map(e => {"
                       "const r = e.getBoundingClientRect(); const o = e.closest('[id]'); "
                       "return {id: o ? o.id : '', left: r.left, top: r.top, right: r.right, "
                       "bottom: r.bottom, width: r.width, height: r.height}})]))", list(css))

    # ---- the dashboard's pieces ---------------------------------------------------
    def banners(self) -> list[dict]:
        return self.js("return Array.from(document.querySelectorAll('.verdict')).map(b => ({"
                       "phase: b.dataset.phase, resource: b.dataset.resource, "
                       "model: b.dataset.model, text: b.innerText}))")

    def traces(self, graph_id: str) -> list[dict]:
        """The plotly traces the browser holds for one graph: name, meta, point count."""
        return self.js("const p = document.querySelector('#' + arguments[0] + "
                       "' .js-plotly-plot'); return p && p.data ? p.data.map(t => ({"
                       "name: t.name, meta: t.meta || null, n: (t.x || []).length, "
                       "y: (t.y || []).slice(0, 200)})) : null", graph_id)

    def text(self, css: str) -> str:
        return self.js("const e = document.querySelector(arguments[0]); "
                       "return e ? e.innerText : ''", css)

    def choose(self, dropdown_id: str, option: str) -> None:
        """Pick ``option`` in a Dash dropdown, as a user does: open it, click the option."""
        from selenium.webdriver.common.by import By

        self.driver.find_element(By.ID, dropdown_id).click()
        self.wait_for(lambda: self.driver.find_elements(By.CSS_SELECTOR, "[role=option]"),
                      10, f"the options of {dropdown_id}")
        for el in self.driver.find_elements(By.CSS_SELECTOR, "[role=option]"):
            if el.text.strip() == option:
                el.click()
                break
        else:
            raise AssertionError(f"{dropdown_id} has no option {option!r}")
        self.driver.find_element(By.TAG_NAME, "body").send_keys("\ue00c")  # Escape closes it
