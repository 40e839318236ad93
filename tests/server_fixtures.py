"""Helpers for the server tests: a real uvicorn server in a background thread, or `goodserve serve` in a process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs ``app`` on uvicorn in a daemon thread; ``base_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def metric_samples(http: httpx.Client) -> dict:
    """``{(name, frozenset(labels)): value}`` of every sample on /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def wait_idle(engine, timeout: float = 30.0) -> None:
    """Wait until the engine has nothing running or waiting, then check the KV pool: no block in use, and
    ``check_integrity()`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        idle, usage = engine.call(lambda e: (not e.has_unfinished_requests(), e.make_stats().kv_cache_usage))
        if idle:
            break
        assert time.monotonic() < deadline, "engine did not become idle"
        time.sleep(0.02)
    assert usage == 0.0
    engine.call(lambda e: e.core.check_integrity())


class ServeProcess:
    """``goodserve serve`` on the tiny model in a subprocess; stderr (the log) is kept for assertions."""

    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "goodserve.cli", "serve", "--model", model, "--port", str(self.port),
               "--dtype", "float32", "--num-blocks", "512", "--block-size", "4", "--max-model-len", "1024",
               "--log-stats-interval", "0", "--served-model-name", "tiny", *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

    def wait(self, timeout: float) -> tuple[int, str]:
        """Wait for the process to exit; return its status and its whole log."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            pytest.fail(f"server did not exit within {timeout} s:\n{err[-3000:]}")
        return self.proc.returncode, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


class RouterServer:
    """A goodserve router app over ``router`` on uvicorn in a thread; entering gives an httpx client of it."""

    def __init__(self, router) -> None:
        from goodserve.router.app import build_router_app

        self.router = router
        self.thread = ServerThread(build_router_app(router))

    def __enter__(self) -> httpx.Client:
        self.thread.__enter__()
        self.http = httpx.Client(base_url=self.thread.base_url, timeout=60)
        return self.http

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.thread.__exit__(*exc)


class FakeBackend:
    """A stand-in backend on 127.0.0.1 (``http.server`` in a daemon thread): ``GET /health`` answers 200 ``{}``
    and every POST answers 200 ``{}``; ``probes`` counts the GETs of ``/health``, ``posts`` the POSTs (the
    requests a router sent it). ``close()`` stops it: new connections are then refused."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.probes = self.posts = 0

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_GET(self) -> None:
                fake.probes += self.path == "/health"
                self._answer()

            def do_POST(self) -> None:
                fake.posts += 1
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._answer()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def slow_steps(engine, seconds: float):
    """Make every step of an ``AsyncEngine``'s engine thread take at least ``seconds`` longer (so a test can act
    between steps); returns the undo. The thread runs ``Engine.run_step``, so that is what is wrapped."""
    real = engine.engine.run_step

    def slow():
        time.sleep(seconds)
        return real()

    engine.call(lambda e: setattr(e, "run_step", slow))
    return lambda: engine.call(lambda e: e.__dict__.pop("run_step", None))
