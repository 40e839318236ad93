"""The one-shot CLI stays lean: ``goodserve chat`` imports none of the server, grammar or compiler stacks."""

from __future__ import annotations

import os
import subprocess
import sys

from tiny_models import make_tiny_gguf

# Imported by `serve`, structured outputs or torch.compile, never needed to answer one prompt.
HEAVY = ("fastapi", "uvicorn", "starlette", "prometheus_client", "xgrammar", "ray", "httpx", "torch._dynamo",
         "transformers")


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
