"""Every all-to-all algorithm x scheduler x pipelining degree gives the float64 reference
(4 ranks seen as 2 nodes x 2 ranks, capacity and dropless, top-k and SMILE bi-level routing)."""

from __future__ import annotations

import itertools

import pytest
from moeflow.launch import launch_local
from tests.helpers import parity

ALGOS = ["direct", "pairwise", "hier1d", "hier2d", "pipe", "bilevel"]
SCHEDULES = ["sequential", "pipelined", "optsche"]
VARIANTS = [dict(a2a=a, schedule=s, pipeline_degree=r)
            for a, s, r in itertools.product(ALGOS, SCHEDULES, [1, 2, 4])]
NAMES = ["capacity_k2", "dropless_k2", "zero_token_rank", "bigmac_k8", "bilevel_top1",
         "bilevel_dropless_2x2", "shared_gated_capacity"]
WORLD = 4


@pytest.fixture(scope="module")
def results():
    return launch_local(parity.variants_worker, WORLD, NAMES, VARIANTS, 2, timeout_s=300)


@pytest.fixture(scope="module")
def references():
    return {name: parity.reference(name, WORLD) for name in NAMES}


@pytest.mark.multirank
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("index", range(len(VARIANTS)),
                         ids=[f"{v['a2a']}-{v['schedule']}-r{v['pipeline_degree']}"
                              for v in VARIANTS])
def test_variant_matches_reference(results, references, name, index):
    for rank in range(WORLD):
        parity.assert_rank_matches(results[rank][(name, index)], references[name], rank, WORLD,
                                   str(VARIANTS[index]))
