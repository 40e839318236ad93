"""Soak `goodserve serve` with bad clients and one engine fault; check that nothing is lost.

    flock /tmp/goodserve-bench.lock .venv/bin/python scripts/soak.py --num-requests 10000 --concurrency 32

What it does (issue "One bad request never stops the engine"):

* starts ``goodserve serve`` (default model) with ``--inject-step-fault N``, a test-only flag that makes
  engine step N raise, and acts as its supervisor: when the process exits it must exit with status 1, and
  the soak starts it again (without the fault) and carries on;
* sends ``--num-requests`` requests from ``--concurrency`` clients: 30% are aborted by their client at a
  random point (before the answer, after the first streamed chunks, mid non-streamed generation), 1% are
  malformed or hold invalid Unicode (each must be a 400), the rest are ordinary completions and chats,
  streamed or not; a small ``--max-waiting-requests`` makes bursts meet 429s;
* accounts for every request on the client side (finished, aborted, rejected, failed) and compares it with
  the servers' own counters (the first process's exit log, the second's exit log after SIGTERM); a client
  that gets a 429 waits for its Retry-After;
* checks the KV cache at the end (usage 0 and ``check_integrity()``, from the exit log) and that greedy
  outputs of fixed prompts after the soak equal those before it.

Requests that get no response at all (a closed port, or a process that exited before reading them) while
the supervisor restarts the server never reached the API; they are sent again and counted once. If one had
reached the API after all, its server would have counted it, and the comparison of counts would fail.
Prints a JSON summary; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import httpx

PROMPTS = ["The capital of France is", "Write a haiku about caches.", "List three primary colours:",
           "Translate to French: good morning", "def fibonacci(n):", "Why is the sky blue?",
           "东京是日本的首都，", "Emoji story: 🚀🌕👩‍🚀", "Gothic letters: 𐌰𐌱𐌲 mean", "Once upon a time,",
           "SQL to count rows in a table:", "The speed of light is", "Name a prime number above 100:",
           "Summarise: KV caches store keys and values.", "A limerick about GPUs:", "2 + 2 ="]
GREEDY_CHECK = ["The capital of France is", "def fibonacci(n):", "Why is the sky blue?", "东京是日本的首都，"]
OUTCOMES = ("finished", "aborted", "rejected", "failed")


@dataclass
class Spec:
    """One request of the soak."""

    kind: str  # normal | abort | bad
    endpoint: str
    body: Optional[dict]  # None: ``raw`` is sent as the body
    raw: bytes = b""
    stream: bool = False
    abort_after_chunks: int = 0  # streamed aborts: leave after this many chunks (0: before the first)
    abort_after_s: float = 0.0  # non-streamed aborts (and streamed ones at 0 chunks): leave after this long


def make_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        r = rng.random()
        chat = rng.random() < 0.5
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        prompt = rng.choice(PROMPTS)
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        stream = rng.random() < 0.5
        if r < 0.01:
            bad = rng.randrange(4)
            if bad == 0:
                specs.append(Spec("bad", endpoint, None, raw=b'{"prompt": "unterminated'))
            elif bad == 1:
                specs.append(Spec("bad", "/v1/completions", None, raw=b'{"prompt": "x \\ud800 y", "max_tokens": 4}'))
            elif bad == 2:
                specs.append(Spec("bad", "/v1/chat/completions", None,
                                  raw=b'{"messages": [{"role": "user", "content": "\\udfff"}], "stream": true}'))
            else:
                specs.append(Spec("bad", endpoint, {**text, "temperature": -1, "stream": stream}))
        elif r < 0.31:
            body = {**text, "max_tokens": 96, "ignore_eos": True, "stream": stream}
            if stream:
                specs.append(Spec("abort", endpoint, body, stream=True, abort_after_chunks=rng.randrange(4),
                                  abort_after_s=rng.uniform(0.0, 0.3)))
            else:
                # Not sooner than 0.3 s: a client that leaves before its request is delivered has not made
                # a call the server could count (96 tokens take seconds, so these never finish first).
                specs.append(Spec("abort", endpoint, body, abort_after_s=rng.uniform(0.3, 1.0)))
        else:
            body = {**text, "max_tokens": rng.randrange(4, 17), "temperature": rng.choice([0.0, 0.8]),
                    "stream": stream}
            specs.append(Spec("normal", endpoint, body, stream=stream))
    return specs


class ServerDown(Exception):
    """The request got no response at all (closed port, or a server that exited before reading it)."""


async def run_one(c: httpx.AsyncClient, spec: Spec, model: str) -> str:
    """Send one request; return its outcome as the client saw it."""
    headers = {"content-type": "application/json"}
    content = spec.raw if spec.body is None else json.dumps({"model": model, **spec.body}).encode()
    answered = False  # whether any response (a status line) came back
    try:
        if spec.kind == "abort" and not spec.stream:
            # The clock starts once the request is on the wire: a client that leaves before sending it has
            # made no call (this process shares two cores with the server, so sending can take a while).
            sent = asyncio.Event()

            async def trace(event: str, info: dict) -> None:
                if event == "http11.send_request_body.complete":
                    sent.set()

            task = asyncio.create_task(c.post(spec.endpoint, content=content, headers=headers,
                                              extensions={"trace": trace}))
            await asyncio.wait({task, asyncio.create_task(sent.wait())}, return_when=asyncio.FIRST_COMPLETED)
            done, _ = await asyncio.wait({task}, timeout=spec.abort_after_s)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return "aborted"
            r = task.result()
            return classify(r.status_code, r.text)
        if not (spec.body or {}).get("stream"):
            r = await c.post(spec.endpoint, content=content, headers=headers)
            return classify(r.status_code, r.text)
        async with c.stream("POST", spec.endpoint, content=content, headers=headers) as r:
            answered = True
            if r.status_code != 200:
                return classify(r.status_code, (await r.aread()).decode())
            if spec.kind == "abort" and spec.abort_after_chunks == 0:
                await asyncio.sleep(spec.abort_after_s)
                return "aborted"
            chunks, events = 0, []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if events[-1].startswith('{"error"'):
                    return "failed"  # counted by the server when it sent the event
                chunks += 1
                if spec.kind == "abort" and chunks >= spec.abort_after_chunks:
                    return "aborted"
            if not events or events[-1] != "[DONE]":
                return "lost"
            return "finished"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as e:
        if answered:
            return "lost"
        # No response at all: the port was closed, or the process exited before its server read the
        # request (a restart). The request never reached the API; it is sent again.
        raise ServerDown() from e
    except httpx.HTTPError:
        return "lost"


def classify(status: int, text: str) -> str:
    if status == 200:
        return "finished"
    return "rejected" if status == 429 else "failed"


class Supervisor:
    """Starts `goodserve serve` and restarts it when it exits, keeping every process's log."""

    def __init__(self, port: int, flags: list[str], fault_step: int, log_dir: str) -> None:
        self.port, self.flags, self.fault_step, self.log_dir = port, flags, fault_step, log_dir
        self.procs: list[tuple[subprocess.Popen, str]] = []
        self.exit_codes: list[int] = []
        self.check_outcomes: Counter = Counter()  # outcomes of the soak's own greedy-check requests

    def start(self) -> None:
        n = len(self.procs)
        flags = list(self.flags)
        if n == 0 and self.fault_step:
            flags += ["--inject-step-fault", str(self.fault_step)]
        log = os.path.join(self.log_dir, f"soak-server-{n}.log")
        cmd = [sys.executable, "-m", "goodserve.cli", "serve", "--port", str(self.port), *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append((proc, log))
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited at start; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.5)

    @property
    def current(self) -> subprocess.Popen:
        return self.procs[-1][0]

    def restart_if_exited(self) -> bool:
        rc = self.current.poll()
        if rc is None:
            return False
        self.exit_codes.append(rc)
        self.start()
        return True

    def stop(self) -> None:
        self.current.send_signal(signal.SIGTERM)
        self.exit_codes.append(self.current.wait(60))

    def accounting(self) -> tuple[Counter, list[str]]:
        """Sum the four outcome counts over every process's exit log; also return the KV lines."""
        total: Counter = Counter()
        kv = []
        for _, log in self.procs:
            text = open(log).read()
            m = re.search(r"API calls: finished (\d+), aborted (\d+), rejected (\d+), failed (\d+)", text)
            if m is None:
                raise RuntimeError(f"no accounting line in {log}")
            total.update(dict(zip(OUTCOMES, map(int, m.groups()))))
            kv += re.findall(r"KV cache: .*", text)
        return total, kv


async def greedy(base: str, model: str, sup: Supervisor) -> list[str]:
    """Greedy outputs of the fixed prompts, one request at a time (a batch of one computes the same way
    before and after), on a server that is up: if the fault stopped it, it is restarted first."""
    out: list[str] = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        while len(out) < len(GREEDY_CHECK):
            try:
                r = await c.post("/v1/completions", json={"model": model, "prompt": GREEDY_CHECK[len(out)],
                                                          "max_tokens": 32, "temperature": 0})
            except httpx.ConnectError:
                r = None
            if r is not None:
                sup.check_outcomes[classify(r.status_code, r.text)] += 1
            if r is not None and r.status_code == 200:
                out.append(r.json()["choices"][0]["text"])
            elif not await asyncio.to_thread(sup.restart_if_exited):
                await asyncio.sleep(0.2)
    return out


async def soak(args: argparse.Namespace, sup: Supervisor) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    model = "soak"
    before = await greedy(base, model, sup)
    specs = make_specs(args.num_requests, args.seed)
    queue: asyncio.Queue = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    client_counts: Counter = Counter()
    by_kind: Counter = Counter()
    resent = 0
    restart_lock = asyncio.Lock()
    t0 = time.monotonic()

    async def worker() -> None:
        nonlocal resent
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as c:
            while not queue.empty():
                spec = queue.get_nowait()
                while True:
                    try:
                        outcome = await run_one(c, spec, model)
                        break
                    except ServerDown:
                        resent += 1
                        async with restart_lock:
                            if not await asyncio.to_thread(sup.restart_if_exited):
                                await asyncio.sleep(0.2)
                client_counts[outcome] += 1
                by_kind[(spec.kind, outcome)] += 1
                if outcome == "rejected" or (outcome == "failed" and spec.kind != "bad"):
                    await asyncio.sleep(1.0)  # a 429's Retry-After; or a 503 from a server about to restart
                done = sum(client_counts.values())
                if done % 500 == 0:
                    print(f"{done} requests, {time.monotonic() - t0:.0f} s: {dict(client_counts)}", file=sys.stderr)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    await greedy(base, model, sup)  # (up and serving); the check that counts is the last one below
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        deadline = time.monotonic() + 60
        while True:  # aborts are applied between steps: wait until the engine is idle
            m = (await c.get("/metrics")).text
            running = float(re.search(r"^goodserve:num_requests_running (\S+)", m, re.M).group(1))
            waiting = float(re.search(r"^goodserve:num_requests_waiting (\S+)", m, re.M).group(1))
            usage = float(re.search(r"^goodserve:kv_cache_usage_perc (\S+)", m, re.M).group(1))
            if running == waiting == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    after = await greedy(base, model, sup)
    return {"elapsed_s": round(elapsed, 1), "client": dict(client_counts), "resent_after_connect_error": resent,
            "by_kind": {f"{k}/{o}": v for (k, o), v in sorted(by_kind.items())},
            "kv_usage_when_idle": usage, "greedy_equal": before == after, "greedy_before": before,
            "greedy_after": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fault-step", type=int, default=2500, help="engine step that raises (0: none)")
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--server-flags", default="--served-model-name soak --max-num-seqs 24 --max-waiting-requests 12 "
                                             "--log-stats-interval 30 --shutdown-timeout 5",
                   help="flags for `goodserve serve`")
    args = p.parse_args()
    sup = Supervisor(args.port, args.server_flags.split(), args.fault_step, args.log_dir)
    sup.start()
    try:
        result = asyncio.run(soak(args, sup))
    finally:
        sup.stop()
    server, kv = sup.accounting()
    client = Counter({k: result["client"].get(k, 0) for k in OUTCOMES})
    client.update(sup.check_outcomes)  # the greedy checks' own requests
    checks = {
        "every request accounted for": sum(result["client"].values()) == args.num_requests and
        "lost" not in result["client"],
        # Exact for finished and rejected; a client may leave at the very moment the server fails its request
        # (the engine's death), which each side counts its own way: those can only move between aborted and
        # failed, by no more than the requests in flight at the fault.
        "counts match the servers' counters": all(client[k] == server.get(k, 0) for k in ("finished", "rejected"))
        and client["aborted"] + client["failed"] == server.get("aborted", 0) + server.get("failed", 0)
        and abs(client["aborted"] - server.get("aborted", 0)) <= args.concurrency,
        "one exit for the injected fault": sup.exit_codes[:-1] == ([1] if args.fault_step else []),
        "clean exit on SIGTERM": sup.exit_codes[-1] == 0,
        "no KV block in use, integrity ok": result["kv_usage_when_idle"] == 0.0 and
        bool(kv) and kv[-1] == "KV cache: integrity ok, 0.0% of blocks in use",
        "greedy outputs unchanged": result["greedy_equal"],
    }
    summary = {**result, "client_with_checks": dict(client), "server": dict(server),
               "aborted_by_client_failed_by_server": client["aborted"] - server.get("aborted", 0),
               "exit_codes": sup.exit_codes,
               "kv_log": kv, "checks": checks}
    print(json.dumps(summary, indent=1, ensure_ascii=False))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
