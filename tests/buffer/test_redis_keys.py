"""The Redis key layout has one owner (asyncrl.platform.redis_keys): the Lua scripts and the Python code
use only the suffixes it declares."""

from __future__ import annotations

import re

import pytest

from asyncrl.buffer import scripts
from asyncrl.platform.redis_keys import LAYOUT, SUFFIXES, key, weights_channel, weights_key
from support import ROOT


def lua_suffixes() -> set[str]:
    """Every `p .. '<suffix>'` of every script (p is the job's prefix)."""
    text = "\n".join(v for k, v in vars(scripts).items() if k.isupper() and isinstance(v, str))
    return set(re.findall(r"\bp \.\. '([^']*)'", text))


def test_the_scripts_use_only_declared_suffixes_and_every_declared_one_is_used():
    used = lua_suffixes()
    assert used <= SUFFIXES, used - SUFFIXES
    # "weights" is written by a script too; nothing in the layout is dead.
    assert used == SUFFIXES


def test_no_python_module_builds_a_key_of_its_own():
    # Keys come from `key` (or the scripts' prefix argument), never from string arithmetic.
    for path in [*ROOT.glob("core/**/*.py"), *ROOT.glob("services/**/*.py")]:
        if path.name in ("redis_keys.py",) or "/v1/" in str(path):
            continue
        text = path.read_text()
        assert "asyncrl:{" not in text, f"{path}: a key spelled out; use asyncrl.platform.redis_keys"
        assert not re.search(r"prefix\([^)]*\)\s*\+", text), f"{path}: prefix(...) + ..."


def test_keys_of_a_job_share_one_cluster_hash_slot_and_unknown_ones_are_refused():
    assert key("j", "state") == "asyncrl:{j}:state"
    assert key("j", "batch:b1") == "asyncrl:{j}:batch:b1"
    assert weights_key("j") == weights_channel("j") == "asyncrl:{j}:weights"
    assert all(name.split("<")[0] in SUFFIXES for name in LAYOUT)
    with pytest.raises(ValueError, match="not in the Redis key layout"):
        key("j", "stats")
