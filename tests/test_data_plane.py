"""The data plane a config gets where it names none (:mod:`kvtier.sched.data_plane`): every entry
names a registered policy and a known engine (or offload mode), policies hold no data-plane setting,
and the reference engine's swap path is its config's."""

from __future__ import annotations

import pytest

from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineInputError
from kvtier.sched import make_policy, policy_names
from kvtier.sched.base import LoadOrder, Policy
from kvtier.sched.data_plane import EVALUATED_ON, OFFLOAD_MODES, SECTIONS, default_engine
from kvtier.sched.fetch_path import FETCH_ENGINES
from kvtier.sched.kv_io import IO_ENGINES
from kvtier.sched.load_path import LOAD_ENGINES
from kvtier.sched.swap_copy import SWAP_ENGINES

ENGINES = {"swap": SWAP_ENGINES, "fetch": FETCH_ENGINES, "load": LOAD_ENGINES, "io": IO_ENGINES}
# The table's other column: the offload mode each paper's engine kept (a mode, not an engine).
DEFAULTS = {**ENGINES, "offload": OFFLOAD_MODES}


def test_every_default_names_a_registered_policy_and_a_known_engine() -> None:
    assert set(ENGINES) == set(SECTIONS)
    for policy, sections in EVALUATED_ON.items():
        assert policy in policy_names()
        for section, engine in sections.items():
            assert engine in DEFAULTS[section], (policy, section)


@pytest.mark.parametrize("section", SECTIONS)
def test_a_policy_without_an_entry_gets_the_plain_engine(section: str) -> None:
    assert default_engine({"name": "fcfs"}, section) == "plain"
    assert default_engine({"name": "lmcache_lp", "x": True}, section) == "plain"


def test_policies_carry_no_data_plane() -> None:
    mechanism = {"swap_engine", "transfer", "compression_ratio", "decode_bytes_per_s", "decode_on_device"}
    mechanism |= {
        "page_tokens",
        "segment_tokens",
        "io",
        "chunk_tokens",
        "layerwise",
        "zero_io",
    }  # load path, io
    for name in policy_names():
        assert not mechanism & set(dir(make_policy(name))), name
        assert not hasattr(make_policy(name), "offload"), name  # reading it fails (issue 18 step 4)
    assert not mechanism & set(dir(Policy))
    # A compressed fetch's slowdown is the engine's, from its fetch path (issue 18 step 4).
    assert not (mechanism | {"interference"}) & set(LoadOrder.__dataclass_fields__)


def test_composed_loads_on_strata_kernels_only_with_its_balance_stage() -> None:
    assert default_engine({"name": "composed"}, "load") == "gpu_kernel"
    assert default_engine({"name": "composed", "stages": ["rotation", "async_load"]}, "load") == "plain"
    assert default_engine({"name": "composed", "balance": False}, "load") == "plain"


def test_the_reference_engine_swap_path_is_config() -> None:
    assert EngineConfig().swap_engine is None  # the policy's paper's, by default
    assert EngineConfig(swap_engine="naive").swap_engine == "naive"
    with pytest.raises(EngineInputError, match="swap_engine"):
        EngineConfig(swap_engine="pcie")
