"""``moeflow bench hecate-model`` / ``hecate-fit`` on one process: the mode specs, the batch
search, the router skew, and one measured step (tokens, counted bytes, the recorded ``P'``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.hecate import hecate_fit, hecate_model
from moeflow.cli import build_parser

TINY = dict(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
            moe_every=1, moe=dict(num_experts=4, d_expert=8, top_k=2))


def test_mode_specs():
    assert hecate_model.parse_mode("ep") == {"placement": "ep"}
    got = hecate_model.parse_mode("fssdp:t=4,budget=1.5M,cal,rm")
    assert got["placement"] == "fssdp"
    assert got["fssdp"] == {"materialize": "sparse", "overlap_degree": 4,
                            "memory_budget_bytes": 3 << 19, "calibrate": True,
                            "bandwidth_Bps": 125e6, "rematerialize": True}
    assert hecate_model.parse_mode("fssdp:static")["fssdp"] == {"materialize": "static"}
    for bad in ("fsdp", "fssdp:", "fssdp:t=2,x=1", "fssdp:m"):
        with pytest.raises(ValueError, match="mode"):
            hecate_model.parse_mode(bad)


def test_search_doubles_then_bisects():
    seen = []

    def probe(b):
        seen.append(b)
        return {"peak": 10 * b}

    assert hecate_fit.search(probe, 75, 1, 256)[0] == 7
    assert seen == [1, 2, 4, 8, 6, 7]
    assert hecate_fit.search(lambda b: {"peak": 10 * b}, 5, 1, 256)[0] == 0
    largest, recs = hecate_fit.search(lambda b: {"peak": b}, 10**6, 2, 16)
    assert largest == 16 and [r["batch"] for r in recs] == [2, 4, 8, 16]
    assert all(r["fits"] for r in recs)


def test_skew_freezes_a_zipf_bias_and_a_step_counts_every_token():
    from moeflow.topology import Topology

    topo = Topology.single()
    model, opt = hecate_model.build("tiny", TINY, "ep", 1.0, topo)
    for layer in model.moe_layers():
        b = layer.router.bias
        assert not b.requires_grad
        assert sorted(torch.exp(-b).round().int().tolist()) == [1, 2, 3, 4]   # rank_e^-1
    rec = hecate_model.train_step(model, opt, 3, topo, 0, measure=True,
                                  after_forward=lambda: {"probe": 1})
    assert rec["probe"] == 1 and rec["materialized_held"] == 0
    assert rec["tokens_per_rank"] == [[3 * 8 * 2], [3 * 8 * 2]]   # B x S x top_k, 2 layers
    assert rec["params"] == sum(p.numel() * 4 for p in model.parameters())
    assert rec["optimizer"] >= 2 * rec["grads"] > 0


def test_cli_parses_both_benches():
    args = build_parser().parse_args(["bench", "hecate-fit", "--budget-mib", "64",
                                      "--modes", "ep", "fssdp:t=2,m=2,rm"])
    assert args.func.__name__ == "run_fit" and args.budget_mib == 64
    args = build_parser().parse_args(["bench", "hecate-model", "--batch", "2"])
    assert args.func.__name__ == "run_time" and "fssdp:t=4,budget=1M,cal" in args.modes
