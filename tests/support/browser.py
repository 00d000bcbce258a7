"""Headless Chromium with one page, driven over the Chrome DevTools protocol (:class:`Browser`), and
the processes it and the servers it looks at run in (:func:`start`, :func:`stop`, :func:`alive`):
the UI tests' and ``benchmarks/many_tables.py``'s."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from contextlib import suppress
from pathlib import Path
from typing import Any

import websocket  # websocket-client

from tests.support.pipeline import wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
VIEWPORT = (1400, 900)


def start(command: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
    """A process leading its own process group (so teardown ends its children too), output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)


def stop(process: subprocess.Popen[bytes]) -> None:
    """End the process group: SIGTERM, then SIGKILL for whatever is left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone; make sure its children are too
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        return


def alive(process: subprocess.Popen[bytes], log: Path) -> None:
    if process.poll() is not None:
        raise AssertionError(f"{log.stem} exited with {process.returncode}:\n{log.read_text()[-4000:]}")


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol (``--remote-debugging-port``)."""

    def __init__(self, folder: Path) -> None:
        profile = folder / "profile"
        profile.mkdir(parents=True)
        self.log = folder / "chromium.log"
        self.process = start(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank",
            ],
            self.log,
        )  # fmt: skip
        try:
            active = profile / "DevToolsActivePort"  # Chromium writes the port it chose here

            def devtools_port() -> str | None:
                alive(self.process, self.log)
                words = active.read_text().split() if active.exists() else []
                return words[0] if words else None

            port = wait_until(devtools_port, timeout=30, what="Chromium's DevTools port")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                pages = [t for t in json.load(response) if t["type"] == "page"]
            self.socket = websocket.create_connection(
                pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
            )
        except BaseException:
            stop(self.process)
            raise
        self.calls = 0
        width, height = VIEWPORT
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.enable")
        self.blank = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])  # about:blank

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:  # events arrive in between; the answer carries our id
            message = json.loads(self.socket.recv())
            if message.get("id") == self.calls:
                assert "error" not in message, (method, message["error"])
                return message["result"]

    def open(self, url: str) -> None:
        result = self.call("Page.navigate", url=url)
        assert "errorText" not in result, result

    def text(self) -> str:
        result = self.call(
            "Runtime.evaluate", expression="document.body ? document.body.innerText : ''", returnByValue=True
        )
        return result["result"].get("value", "")

    def links(self) -> list[str]:
        expression = "[...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))"
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]

    def table_rows(self) -> list[list[str]]:
        """The text of every table row's cells on the page."""
        expression = "[...document.querySelectorAll('tr')].map(r => [...r.cells].map(c => c.innerText.trim()))"
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]

    def wait_for(self, *needles: str, timeout: float = 45) -> str:
        """The page's text once it contains every one of ``needles``."""
        last = ""

        def shown() -> str | None:
            nonlocal last
            last = self.text()
            return last if all(needle in last for needle in needles) else None

        try:
            return wait_until(shown, timeout=timeout, what=f"page showing {needles}")
        except TimeoutError as error:
            missing = [n for n in needles if n not in last]
            raise AssertionError(f"the page never showed {missing}; it showed:\n{last[:3000]}") from error

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            stop(self.process)
