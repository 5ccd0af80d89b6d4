"""A headless Chromium driven over its DevTools protocol, for the tests that look at the docs site as a reader
does: the standard library only (the protocol's JSON messages over ``--remote-debugging-pipe``: Chromium reads
commands on its file descriptor 3 and writes answers and events on 4, each message ended by a NUL byte).

    with Browser.start(tmp_path) as b:
        b.open("file:///.../site/index.html")
        b.evaluate("document.title")

:func:`find_chromium` names the browser (``$PROTEUS_CHROMIUM``, else ``chromium``, ``chromium-browser``,
``google-chrome`` on the PATH) or None; the tests skip with that reason when there is none.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import time
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable to use, or None when none is installed."""
    given = os.environ.get("PROTEUS_CHROMIUM")
    if given:
        return given
    return next((path for name in NAMES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    """The browser answered with an error, went away, or did not answer in time."""


class Browser:
    """One headless Chromium and one page (a tab) in it, driven by DevTools protocol commands."""

    def __init__(self, pid: int, to_browser: int, from_browser: int, timeout: float) -> None:
        self.pid, self._out, self._in, self.timeout = pid, to_browser, from_browser, timeout
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.session = ""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=None)["targetId"]
        self.session = self.send(
            "Target.attachToTarget", {"targetId": target, "flatten": True}, session=None
        )["sessionId"]
        self.send("Page.enable")

    @classmethod
    def start(cls, profile: Path, exe: str | None = None, timeout: float = 30.0) -> Browser:
        """Start ``exe`` (default :func:`find_chromium`) headless with a fresh profile in ``profile``."""
        exe = exe or find_chromium()
        if exe is None:
            raise BrowserError("no Chromium found")
        args = [
            exe, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--window-size=1280,1600",
            f"--user-data-dir={profile}", "about:blank",
        ]  # fmt: skip
        # the pipes' ends kept above the descriptors the browser gets (3: its commands, 4: its answers)
        cmd_r, cmd_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in os.pipe())
        out_r, out_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in os.pipe())
        log = profile / "chromium.log"
        actions = [
            (os.POSIX_SPAWN_DUP2, cmd_r, 3),
            (os.POSIX_SPAWN_DUP2, out_w, 4),
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        pid = os.posix_spawn(exe, args, os.environ, file_actions=actions)
        os.close(cmd_r)
        os.close(out_w)
        try:
            return cls(pid, cmd_w, out_r, timeout)
        except BaseException:
            cls._stop(pid, cmd_w, out_r)
            raise

    # ------------------------------------------------------------------------------------------ protocol
    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = "") -> Any:
        """Send one command (to the page's session unless ``session`` is None: the browser) and return its
        result; events that arrive meanwhile are kept in :attr:`events`."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None and self.session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError(f"no answer from the browser within {self.timeout:g} s")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise BrowserError("the browser went away")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # ---------------------------------------------------------------------------------------------- page
    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Go to ``url`` and wait until its document has loaded."""
        self.evaluate("window.__left = true")
        self.send("Page.navigate", {"url": url})
        self.wait_for_new_document()

    def wait_for_new_document(self) -> None:
        """Wait until the page holds a document other than the one marked by ``window.__left`` (set before
        a click or a navigation), fully loaded."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if self.evaluate("window.__left !== true && document.readyState === 'complete'"):
                    return
            except BrowserError:  # the page is between two documents
                pass
            time.sleep(0.05)
        raise BrowserError(f"no new document loaded within {self.timeout:g} s")

    def click(self, selector: str, index: int) -> str:
        """Click the ``index``-th element matching ``selector`` (as a reader's click does: the element's
        ``click()``, which follows a link) and wait for the document it leads to; return the link's href."""
        href = self.evaluate(
            f"(() => {{ const a = document.querySelectorAll({json.dumps(selector)})[{index}]; "
            "window.__left = true; a.click(); return a.href; })()"
        )
        self.wait_for_new_document()
        return str(href)

    # ----------------------------------------------------------------------------------------- clean-up
    @staticmethod
    def _stop(pid: int, to_browser: int, from_browser: int) -> None:
        for fd in (to_browser, from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(pid, 15)
            for _ in range(100):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
                time.sleep(0.05)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Stop the browser."""
        self._stop(self.pid, self._out, self._in)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
