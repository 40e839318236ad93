"""``goodserve serve`` as a real process: it exits non-zero when its engine dies (so a supervisor restarts it)
and shuts down within ``--shutdown-timeout`` on SIGTERM under load, with every API call accounted for."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time

import httpx
import pytest

from server_fixtures import ServeProcess
from tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def _accounting(log: str) -> dict[str, int]:
    m = re.search(r"API calls: finished (\d+), aborted (\d+), rejected (\d+), failed (\d+)", log)
    assert m, log[-3000:]
    return dict(zip(("finished", "aborted", "rejected", "failed"), map(int, m.groups())))


def test_engine_death_exits_nonzero_within_seconds(tiny_model):
    """A bug inside a step: the in-flight request gets an error at once and the process exits with status 1."""
    srv = ServeProcess(tiny_model, "--inject-step-fault", "3", "--shutdown-timeout", "2")
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30)
        t_fault = time.monotonic()
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-2])["error"]["type"] == "ServiceUnavailableError" and events[-1] == "[DONE]"
        rc, log = srv.wait(timeout=15)
        assert rc == 1 and time.monotonic() - t_fault < 10
        assert "engine loop died" in log
        assert _accounting(log) == {"finished": 0, "aborted": 0, "rejected": 0, "failed": 1}
    finally:
        srv.close()


def test_sigterm_under_load_exits_in_time_with_every_call_accounted(tiny_model):
    """SIGTERM while requests stream: no new connection is admitted, in-flight calls get the shutdown
    timeout, then the rest are aborted and answered with a 503 (an error event when streamed); the exit
    log accounts for every call, and the KV cache is intact with no block in use."""
    timeout = 1.5
    srv = ServeProcess(tiny_model, "--shutdown-timeout", str(timeout))
    results: list[str] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": f"Request {i}", "max_tokens": 900, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            if body["stream"]:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    text = "".join([chunk async for chunk in r.aiter_text()])
                if '"shutting_down"' in text and text.rstrip().endswith("[DONE]"):
                    results.append("shutting_down")
                else:
                    results.append("finished" if text.rstrip().endswith("[DONE]") else "cut")
            else:
                r = await c.post("/v1/completions", json=body)
                results.append("finished" if r.status_code == 200 else r.json()["error"]["code"])
        except httpx.HTTPError:
            results.append("cut")

    async def load() -> float:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(8)]
            while (await c.get("/metrics")).text.count("goodserve:num_requests_running 8") == 0:
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
            return t0

    try:
        t0 = asyncio.run(load())
        rc, log = srv.wait(timeout=timeout + 15)
        elapsed = time.monotonic() - t0
        assert rc == 0 and elapsed < timeout + 8, (rc, elapsed)
        counts = _accounting(log)
        assert len(results) == 8 and set(results) <= {"finished", "shutting_down"}, results
        assert counts == {"finished": results.count("finished"), "aborted": 0, "rejected": 0,
                          "failed": results.count("shutting_down")}
        assert "KV cache: integrity ok, 0.0% of blocks in use" in log
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.base_url + "/health", timeout=2)
    finally:
        srv.close()


def test_a_call_cut_short_by_shutdown_is_answered_and_counted(tiny_model):
    """A client still sending its body when SIGTERM comes: after the timeouts its call is cancelled, answered
    with a 503 ``shutting_down`` and counted as failed (not lost from the exit log)."""
    srv = ServeProcess(tiny_model, "--shutdown-timeout", "0.5")
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 30\r\n\r\n{\"pro")
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        rc, log = srv.wait(timeout=15)
        reply = sock.recv(4096).decode(errors="replace")
        sock.close()
        assert rc == 0 and " 503 " in reply.split("\r\n")[0] and "shutting_down" in reply
        assert _accounting(log) == {"finished": 0, "aborted": 0, "rejected": 0, "failed": 1}
    finally:
        srv.close()
