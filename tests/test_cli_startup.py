"""The one-shot CLI stays lean: ``goodserve chat`` imports none of the server, grammar or compiler stacks."""

from __future__ import annotations

import os
import subprocess
import sys

from tiny_models import make_tiny_gguf

# Imported by `serve`, the other commands, structured outputs, torch.compile or a progress bar, never needed to
# answer one prompt.
HEAVY = ("fastapi", "uvicorn", "starlette", "prometheus_client", "xgrammar", "ray", "httpx", "torch._dynamo",
         "transformers", "tqdm.auto", "goodserve.bench", "goodserve.server", "goodserve.sim", "goodserve.router")


def test_one_shot_chat_imports_nothing_heavy(tmp_path):
    path, _ = make_tiny_gguf(tmp_path, "llama")
    code = (
        "import sys\n"
        "from goodserve.cli import main\n"
        f"rc = main(['--log-level', 'WARNING', 'chat', 'Hello there', '--max-tokens', '3', '--model', {path!r}])\n"
        f"print('RC', rc, 'LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "RC 0 LOADED []" in out.stdout, out.stdout + out.stderr


def test_one_shot_process_exits_with_its_output_and_code(tmp_path):
    """``python -m goodserve.cli chat`` ends with ``os._exit`` (skipping the interpreter's teardown): its
    answer and log line still reach a pipe, and its exit code is main's (0, or 2 on bad input)."""
    path, _ = make_tiny_gguf(tmp_path, "llama")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "goodserve.cli", "chat", "Hello there", "--model", path]
    ok = subprocess.run(cmd + ["--max-tokens", "3", "--temperature", "0"], capture_output=True, text=True,
                        env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith("\n") and len(ok.stdout) > 1
    assert "prompt + 3 output tokens, finish_reason=length" in ok.stderr
    bad = subprocess.run(cmd + ["--temperature", "-1"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "goodserve: error:" in bad.stderr and "temperature" in bad.stderr


def test_command_word_found_past_the_log_level():
    from goodserve.cli import _command, build_parser

    assert _command(["--log-level", "DEBUG", "chat", "hi"]) == "chat"
    assert _command(["--log-level=DEBUG", "generate", "--max-tokens", "3", "x"]) == "generate"
    assert _command(["bench", "micro"]) == "bench" and _command(["--help"]) is None
    lean = build_parser(one_shot_only=True)
    assert lean.parse_args(["chat", "hi", "--max-tokens", "3"]).max_tokens == 3
    assert build_parser().parse_args(["bench", "micro"]).func.__name__ == "run_micro"
