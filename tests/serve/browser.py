"""A real headless browser for the page's tests: Debian's chromium, installed where missing (as root, with
apt-get, once at a time), driven over the DevTools protocol on a websocket (aiohttp's client, which Ray
already brings). Without chromium and no way to install it, the tests skip and say why."""
from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_chromium() -> str:
    """chromium's path; installs Debian's package where it is missing (under a lock: one install at a
    time across test processes), or skips the test with the reason."""
    path = find_chromium()
    if path:
        return path
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("no chromium here, and no apt-get as root to install it: `apt-get install chromium`")
    with open(Path(tempfile.gettempdir()) / "ggml-dist-chromium-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = find_chromium()              # installed meanwhile by another process
        if path:
            return path
        install = ["apt-get", "install", "-y", "-o", "DPkg::Lock::Timeout=300", "chromium"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(install, check=False, capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:               # stale package lists: once more after an update
            subprocess.run(["apt-get", "update"], check=False, capture_output=True, timeout=600, env=env)
            r = subprocess.run(install, check=False, capture_output=True, text=True, timeout=900, env=env)
        path = find_chromium()
        if path is None:
            pytest.skip(f"chromium could not be installed (`apt-get install chromium` exit {r.returncode}: "
                        f"{r.stderr.strip()[-300:]})")
        return path


class Browser:
    """One headless chromium with one page, over the DevTools protocol. call() sends a command to the page
    and waits for its answer; the page's uncaught exceptions are kept in `errors`."""

    def __init__(self, exe: str, profile: Path) -> None:
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) == 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not open its DevTools port (exit {self.proc.poll()})")
            time.sleep(0.05)
        port, path = port_file.read_text().split()
        self.errors: list[str] = []
        self._next_id = 0
        self.session: str | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="cdp", daemon=True)
        self._thread.start()
        self._run(self._connect(f"ws://127.0.0.1:{port}{path}"))
        target = self.call("Target.createTarget", {"url": "about:blank"}, page=False)["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, page=False)
        self.session = attached["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self, url: str) -> None:
        import aiohttp
        self._http = aiohttp.ClientSession()
        self.ws = await self._http.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None:
                fut.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                d = data["params"]["exceptionDetails"]
                self.errors.append(d.get("exception", {}).get("description") or d.get("text", "?"))

    async def _send(self, method: str, params: dict, session: str | None) -> dict:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        fut = self.loop.create_future()
        self._waiting[self._next_id] = fut
        await self.ws.send_str(json.dumps(msg))
        return await fut

    def call(self, method: str, params: dict | None = None, page: bool = True, timeout: float = 60) -> dict:
        got = self._run(self._send(method, params or {}, self.session if page else None), timeout)
        if "error" in got:
            raise RuntimeError(f"{method}: {got['error']}")
        return got["result"]

    # -- what a test does with the page ------------------------------------------------------------------
    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'", what=f"{url} to load")

    def eval(self, expr: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr[:80]}: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 120, what: str = "") -> Any:
        """expr's value once it is truthy, polled; a generous deadline (the machine may be busy)."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.eval(f"((v) => v instanceof Node ? true : v)({expr})")   # a node comes back as {}
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or expr} "
                                     f"(page errors: {self.errors})")
            time.sleep(0.1)

    def type(self, selector: str, text: str) -> None:
        """Focus the element and type text as keyboard input would insert it."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", {"text": text})

    def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13}
        self.call("Input.dispatchKeyEvent", {"type": "keyDown", "text": "\r", **key})   # text: a form submits
        self.call("Input.dispatchKeyEvent", {"type": "keyUp", **key})

    def click(self, selector: str) -> None:
        """A mouse click at the element's centre (the element must be visible)."""
        box = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView();"
                        f" const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if hasattr(self, "ws"):
            async def shut() -> None:
                await self.ws.close()
                await self._http.close()
            try:
                self._run(shut(), timeout=10)
            except Exception:  # noqa: BLE001 - the browser may be gone already; it is ended below
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
