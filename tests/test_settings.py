"""Settings are declared once (engine/settings.py): the CLI and the README table come from them."""
from __future__ import annotations

import dataclasses

import pytest

from engine.args import EngineArgs
from engine.settings import flag_name, flags
from kvstore.config import SELECTORS, KVStoreConfig
from scheduler.scheduler import SchedulerConfig
from server.cli import build_parser, engine_args
from server.settings import README, ServerSettings, readme_with_flags


def _sample(f: dataclasses.Field) -> str:
    """A valid non-default value for the flag, as typed on a command line."""
    if f.metadata["choices"]:
        return next(str(c) for c in f.metadata["choices"] if c != f.default)
    return {"port": "8123", "max_model_len": "1024", "sparse_prior_share": "0.5",
            "kv_device_gb": "0.5", "kv_host_gb": "0.25", "kv_disk_gb": "0.5",
            "page_size": "32", "drain_seconds": "6"}.get(
        f.name, "7" if f.type in ("int", "int | None")
        else "0.5" if f.type in ("float", "float | None") else "x")


def test_every_setting_is_a_serve_flag_that_reaches_its_field():
    parser = build_parser()
    for cls in (ServerSettings, EngineArgs):
        for f in flags(cls):
            value = [] if f.type == "bool" else [_sample(f)]     # a switch takes none
            ns = parser.parse_args(["serve", flag_name(f), *value])
            assert getattr(ns, f.name) is not None, f.name
    ns = parser.parse_args(["serve", "--kv-host-gb", "0.25", "--selector", "mean",
                            "--threads", "3"])
    args = engine_args(ns, "m")
    assert (args.kv_host_gb, args.selector, args.threads) == (0.25, "mean", 3)
    assert args.sparse_budget == EngineArgs().sparse_budget        # unset: the field's default


def test_unknown_or_misspelled_settings_are_errors():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--sparse-budjet", "64"])
    assert exc.value.code == 2
    with pytest.raises(TypeError):
        EngineArgs(sparse_budjet=64)
    with pytest.raises(ValueError, match="--pipeline must be one of"):
        EngineArgs(pipeline="fast")
    with pytest.raises(ValueError, match="--log-level must be one of"):
        ServerSettings(log_level="loud")


def test_defaults_are_written_once():
    # the engine's defaults are the KV store's and the scheduler's own
    assert EngineArgs().kv_store_config() == KVStoreConfig()
    sched = SchedulerConfig()
    args = EngineArgs()
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.max_waiting) == \
        (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_waiting)


def test_selector_names_match_the_kernels():
    from kernels.page_select import _SELECTOR_NAMES
    from kvstore.selection import _kernel
    assert {_kernel(s) for s in SELECTORS} == set(_SELECTOR_NAMES)
    assert SELECTORS[:len(_SELECTOR_NAMES)] == _SELECTOR_NAMES


def test_readme_flag_table_is_generated_from_the_settings():
    text = README.read_text()
    assert readme_with_flags(text) == text, \
        "README.md's flag table is stale: run python -m server.settings --write-readme"
    for cls in (ServerSettings, EngineArgs):
        for f in flags(cls):
            assert f"`{flag_name(f)}`" in text
