"""The native kernels are torch ops built at install: the profiler names them, fake tensors see their shapes,
and a build is found by its key instead of being compiled again (issue 30)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from goodserve import LLM, SamplingParams
from goodserve.models import native, native_build
from tiny_models import make_tiny_gguf

pytestmark = pytest.mark.skipif(not native.load(), reason="the native kernels cannot be built here")


def test_the_profiler_shows_each_kernel_by_name(tmp_path):
    path, _ = make_tiny_gguf(tmp_path, "llama")
    llm = LLM(path, num_blocks=64, log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    names = {e.key for e in prof.key_averages()}
    for op in ("goodserve::rms_norm", "goodserve::rope", "goodserve::silu_mul", "goodserve::paged_decode_attention",
               "goodserve::argmax"):
        assert op in names, (op, sorted(n for n in names if n.startswith("goodserve")))


def test_fake_implementations_give_each_ops_output_shape():
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        out, h = torch.ops.goodserve.rms_norm(x, torch.empty(64, dtype=torch.bfloat16), 1e-5, x)
        assert out.shape == (5, 64) and h.shape == (5, 64)
        assert torch.ops.goodserve.silu_mul(torch.empty(5, 64, dtype=torch.bfloat16)).shape == (5, 32)
        assert torch.ops.goodserve.argmax(torch.empty(3, 10)).dtype == torch.int64
        packed = torch.empty(4, 2, 16, 16, 2, dtype=torch.bfloat16)
        assert torch.ops.goodserve.bi_gemm(x, packed, 64, None).shape == (5, 64)


def test_a_build_is_found_by_its_key():
    cxx = native_build.compiler()
    path = native_build.library_path(cxx)
    assert path.exists()  # built at install (scripts/setup.sh) or by the first load
    assert native_build.build(cxx) == path  # found, not compiled again
