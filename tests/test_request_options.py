"""A request's options travel as one value (issue 30): built once where the request enters, the engine's
defaults applied there only (:meth:`EngineConfig.request_options`), carried unopened to the scheduler's
``Request``; and ``EngineCore.step()`` / ``Engine.run_step()`` say what they did."""

from __future__ import annotations

import math

import pytest

from goodserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine
from goodserve.kv_transfer import KVTransferParams
from goodserve.request_options import UNSET, RequestOptions
from goodserve.sampling_params import SamplingParams
from goodserve.server.slo_classes import parse_slo_classes, resolve_slo
from goodserve.validation import ParamError


def _config(**kw) -> EngineConfig:
    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=8, intermediate_size=16,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                        max_position_embeddings=64)
    return EngineConfig("m", model, CacheConfig(16, 4), SchedulerConfig(max_model_len=64), **kw)


def test_the_engines_defaults_apply_where_the_request_gives_none_and_only_there():
    config = _config(slo_ttft=2.0, slo_tpot=0.15)
    assert config.request_options() == RequestOptions(slo_ttft=2.0, slo_tpot=0.15, slo_class="default")
    assert config.request_options(slo_ttft=0.5) == RequestOptions(slo_ttft=0.5, slo_tpot=0.15, slo_class="custom")
    # A class without a TPOT limit ("-") has none: not the engine's default.
    classes = parse_slo_classes(["batch:20000:-"])
    slo = resolve_slo("batch", None, None, classes)
    assert (slo.ttft, slo.tpot, slo.name) == (20.0, None, "batch")
    options = config.request_options(3, "salt", slo.ttft, slo.tpot, slo.name, {"do_remote_decode": True})
    assert options == RequestOptions(3, "salt", 20.0, None, "batch", KVTransferParams(do_remote_decode=True))
    nothing = resolve_slo(None, None, None, classes)
    assert (nothing.ttft, nothing.tpot, nothing.name) == (UNSET, UNSET, "default")
    assert config.request_options(slo_ttft=nothing.ttft, slo_tpot=nothing.tpot).slo_tpot == 0.15


@pytest.mark.parametrize("field, value", [("priority", 1.5), ("priority", True), ("cache_salt", 7),
                                          ("slo_ttft", 0.0), ("slo_tpot", math.inf), ("slo_ttft", -1.0)])
def test_a_malformed_option_names_its_field(field, value):
    with pytest.raises(ParamError) as e:
        RequestOptions(**{field: value})
    assert e.value.param == field
    with pytest.raises(ParamError, match="kv_transfer_params"):
        _config().request_options(kv_transfer_params={"do_remote_decode": True, "bogus": 1})


def test_the_request_carries_the_options_unopened_and_run_step_says_what_it_did(tmp_path):
    from tiny_models import make_tiny_hf_model

    engine = Engine(EngineArgs(model=make_tiny_hf_model(tmp_path, "llama"), dtype="float32", num_blocks=32,
                               block_size=4, log_stats_interval=0, slo_tpot=0.5))
    options = engine.config.request_options(priority=2, cache_salt="t")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a", options=options)
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True), request_id="b")
    requests = engine.core.scheduler._requests
    assert requests["a"].options is options and requests["a"].slo_tpot == 0.5 and requests["a"].priority == 2
    assert requests["b"].options == RequestOptions(slo_tpot=0.5)  # no options: the engine's defaults
    step = engine.run_step()
    assert [s.request_id for s in step.schedule.scheduled] == ["a", "b"]
    assert step.schedule.total_num_scheduled_tokens == 6  # both prompts, each sampling its first token
    assert [(o.request_id, len(o.token_ids), o.finished) for o in step.outputs] == [("a", 1, False), ("b", 1, False)]
    step = engine.run_step()
    assert step.schedule.num_decode_tokens == 2 and all(o.finished for o in step.outputs)
    assert not engine.has_unfinished_requests()
