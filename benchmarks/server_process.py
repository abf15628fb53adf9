"""A running ``python -m exporters.serve`` in a process of its own, as the tests and ``benchmarks.serve`` start it:
its URL, an ``openai`` client for it, raw HTTP as curl sends it, its RSS."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent

KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running ``exporters.serve`` process: its base URL, its output, a raw HTTP helper."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}/v1"

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", KEY), max_retries=0, **kwargs)

    def raw(self, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict, dict]:
        """POST ``body`` (GET without one) as curl sends it: the status, the headers and the JSON answer."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(self.url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) / 1024


@contextmanager
def serving(run: Path, log: Path, *args: str) -> Iterator[Server]:
    """The server over ``run``, its console into ``log``."""
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "exporters.serve", str(run), f"port={port}", f"api_key={KEY}",
                                 *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    server = Server(proc, port)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the server ended: {log.read_text()}")
            try:
                if server.raw("/models")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        else:
            raise AssertionError("the server did not answer within 300 s")
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=60)


