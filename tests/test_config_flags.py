"""Engine flags derived from the config dataclasses (issue 30): ``serve`` and ``simulate`` declare the
scheduler's and the KV pool's flags once, from :class:`SchedulerConfig` and :class:`CacheConfig`, and
``EngineArgs``' defaults are those configs' own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from goodserve.cli import build_parser
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.config_flags import add_scheduler_flags, scheduler_flag_dests, split_choices
from goodserve.engine.args import EngineArgs


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def parser_defaults() -> dict:
    """The flags' own defaults by destination."""
    p = argparse.ArgumentParser()
    add_scheduler_flags(p)
    return {d: p.get_default(d) for d in scheduler_flag_dests()}


def test_serve_and_simulate_share_the_scheduler_flags_and_their_defaults():
    serve = _parse("serve")
    sim = _parse("simulate", "--model", "llama-3-8b")
    dests = scheduler_flag_dests()
    assert set(dests) == {"max_num_batched_tokens", "max_num_seqs", "max_model_len", "scheduling_policy",
                          "scheduler", "shed_load", "num_blocks", "block_size", "enable_prefix_caching"}
    assert {d: getattr(serve, d) for d in dests} == {d: getattr(sim, d) for d in dests} == parser_defaults()
    args = EngineArgs()
    assert {d: getattr(args, d) for d in dests} == parser_defaults()
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.scheduling_policy, args.scheduler) == \
        (SchedulerConfig().max_num_batched_tokens, SchedulerConfig().max_num_seqs, SchedulerConfig().policy,
         SchedulerConfig().mode)
    assert (args.block_size, args.enable_prefix_caching) == (CacheConfig(1).block_size,
                                                             CacheConfig(1).enable_prefix_caching)


def test_a_flag_reaches_both_commands():
    for argv in (("serve",), ("simulate", "--model", "llama-3-8b")):
        ns = _parse(*argv, "--max-num-seqs", "7", "--no-prefix-caching", "--block-size", "32")
        assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.block_size) == (7, False, 32)
    assert EngineArgs.from_cli_args(_parse("serve", "--scheduling-policy", "slo", "--shed-load")).shed_load
    with pytest.raises(SystemExit):
        _parse("serve", "--scheduling-policy", "lifo")  # one choice on serve


def test_simulate_compares_comma_separated_choices_and_names_a_bad_one():
    assert split_choices("fcfs, slo", "--scheduling-policy", ("fcfs", "priority", "slo")) == ["fcfs", "slo"]
    with pytest.raises(ValueError, match="--scheduler: orca is not one of chunked"):
        split_choices("chunked,orca", "--scheduler", ("chunked", "static"))


def test_every_flag_field_says_what_it_is():
    for cls in (SchedulerConfig, CacheConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("flag", "--").startswith("--") and f.metadata.get("help", "x")


def test_router_and_serve_ray_name_the_routing_policy_alike():
    """``--routing`` on both commands; ``router`` still takes ``--policy`` as an alias of the same flag."""
    assert _parse("router").routing == _parse("serve").routing == "round-robin"
    assert _parse("router", "--routing", "prefix-affinity").routing == "prefix-affinity"
    assert _parse("router", "--policy", "least-outstanding-tokens").routing == "least-outstanding-tokens"
    assert not hasattr(_parse("router", "--policy", "prefix-affinity"), "policy")
    assert _parse("serve", "--ray", "--replicas", "2", "--routing", "prefix-affinity").routing == "prefix-affinity"
    with pytest.raises(SystemExit):
        _parse("router", "--policy", "random")
