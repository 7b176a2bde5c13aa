"""What ``actors.kv_on_update`` does to vLLM's KV cache at a weight update
(the engine side runs in tests/integration/test_kv_on_update.py)."""

from __future__ import annotations

import pytest

from actors.config import ActorConfig
from actors.engine import KVPlan, kv_plan


def test_keep_leaves_running_requests_their_kv_and_salts_new_requests_away_from_it() -> None:
    assert kv_plan("keep") == KVPlan(clear_cache=False, new_cache_salt=True)


def test_recompute_preempts_running_requests_and_resets_the_prefix_cache() -> None:
    assert kv_plan("recompute") == KVPlan(clear_cache=True, new_cache_salt=False)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_on_update"):
        kv_plan("auto")  # type: ignore[arg-type]


def test_actors_keep_the_kv_by_default() -> None:
    assert ActorConfig().kv_on_update == "keep"
