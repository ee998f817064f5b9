"""The SmartMoE-style re-placement search (moeflow/strategies/fssdp/replace.py, HECATE Section 2.3):
it balances a skewed load better than the identity assignment, keeps every rank's expert count,
never makes the predicted most-loaded rank worse, and is deterministic; the option's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow import MoEConfig
from moeflow.errors import ConfigError
from moeflow.strategies.fssdp.replace import balanced_owners, rank_loads, replacement


def zipf(E: int, s: float, seed: int = 7) -> np.ndarray:
    ranks = np.random.default_rng(seed).permutation(E) + 1
    return 1000.0 * ranks.astype(float) ** -s


def even(E: int, world: int) -> list[int]:
    return [e // (E // world) for e in range(E)]


@pytest.mark.parametrize("E,world,s", [(8, 4, 1.0), (16, 4, 1.5), (32, 8, 1.2), (12, 3, 0.8)])
def test_balances_a_skewed_load_better_than_the_identity(E, world, s):
    loads = zipf(E, s)
    ident = even(E, world)
    new = balanced_owners(loads, ident, world)
    assert np.bincount(new, minlength=world).tolist() == [E // world] * world  # no replicas
    before = rank_loads(loads, ident, world).max()
    after = rank_loads(loads, new, world).max()
    assert after < before
    if E == 8:     # against the best of all 105 pairings: the greedy rule's 4/3 bound
        assert after <= 4 / 3 * best_pairing(loads)


def best_pairing(loads) -> float:
    def go(rest):
        if not rest:
            return 0.0
        a = rest[0]
        return min(max(loads[a] + loads[b], go([e for e in rest[1:] if e != b]))
                   for b in rest[1:])
    return go(list(range(len(loads))))


def test_pairs_the_most_and_least_loaded_experts():
    loads = np.array([100.0, 90.0, 10.0, 1.0])     # identity: rank 0 carries 190
    new = balanced_owners(loads, [0, 0, 1, 1], 2)
    assert sorted([{e for e in range(4) if new[e] == r} for r in range(2)],
                  key=min) == [{0, 3}, {1, 2}]
    assert rank_loads(loads, new, 2).tolist() == [101.0, 100.0]


def test_deterministic_and_stable_on_ties():
    loads = zipf(16, 1.0)
    owners = [3, 1, 0, 2] * 4
    runs = {tuple(balanced_owners(loads.copy(), list(owners), 4)) for _ in range(5)}
    assert len(runs) == 1                          # the same on every rank
    flat = np.full(8, 5.0)                         # equal loads: nothing moves
    assert replacement(flat, even(8, 4), 4) == even(8, 4)


def test_keeps_the_current_owners_unless_it_lowers_the_peak():
    loads = np.array([50.0, 0.0, 0.0, 0.0])        # one hot expert: no permutation helps
    assert replacement(loads, [0, 0, 1, 1], 2) == [0, 0, 1, 1]
    rng = np.random.default_rng(0)
    for _ in range(50):                            # never worse than the current assignment
        loads = rng.pareto(1.2, 12)
        owners = rng.permutation(even(12, 4)).tolist()
        new = replacement(loads, owners, 4)
        assert rank_loads(loads, new, 4).max() <= rank_loads(loads, owners, 4).max()
        assert np.bincount(new, minlength=4).tolist() == [3] * 4


def test_refusals():
    with pytest.raises(ConfigError, match="one load per expert"):
        balanced_owners([1.0, 2.0], [0, 0, 1], 2)
    with pytest.raises(ConfigError, match="outside"):
        balanced_owners([1.0, 2.0], [0, 2], 2)
    base = dict(d_model=8, d_expert=8, num_experts=4, placement="fssdp")
    with pytest.raises(ConfigError, match="replace_every=-1"):
        MoEConfig(**base, fssdp=dict(replace_every=-1))
    with pytest.raises(ConfigError, match="materialize='static'"):
        MoEConfig(**base, fssdp=dict(replace_every=2, materialize="sparse", overlap_degree=1))
    with pytest.raises(ConfigError, match="keep one"):
        MoEConfig(**base, fssdp=dict(replace_every=2, reshard_every=3))
    assert MoEConfig(**base, fssdp=dict(replace_every=2)).fssdp.replace_every == 2
