"""``--pp-layout`` (moeflow.pipeline_parallel.mesh): where the pipeline ranks sit on the nodes.
The rank arithmetic of both layouts, the refusals naming the flags, and float64 parity of
PP 2 x EP 2 with the stages strided over two emulated nodes of 2 ranks (``within-nodes``: EP
across the nodes, the pipeline inside each) with PP 1 x EP 2 (tests/helpers/pipeline_cases.py)
under 1F1B."""

from __future__ import annotations

import argparse

import pytest
import torch

from moeflow.config import ConfigError, ModelConfig, TrainConfig
from moeflow.launch import launch_local
from moeflow.pipeline_parallel.layout_checks import check_pipeline
from moeflow.pipeline_parallel.mesh import (global_rank, pipeline_coords, stage_dp_rank,
                                            stage_ranks_per_node)
from tests.helpers import pipeline_cases as cases


def test_both_layouts_number_the_ranks():
    # 2 x 2: across-nodes puts stage 0 on ranks 0, 1 (node 0); within-nodes on ranks 0, 2
    assert [pipeline_coords(r, 4, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [pipeline_coords(r, 4, 2, "within-nodes") for r in range(4)] == \
        [(0, 0), (1, 0), (0, 1), (1, 1)]
    for layout in ("across-nodes", "within-nodes"):
        for r in range(8):
            assert global_rank(*pipeline_coords(r, 8, 4, layout), 8, 4, layout) == r
    assert [stage_dp_rank(r, 4, 2, "within-nodes") for r in range(4)] == [0, 0, 1, 1]
    assert stage_ranks_per_node(4, 2, 2) == 2                     # a stage fills a node
    assert stage_ranks_per_node(4, 2, 2, "within-nodes") == 1     # one rank per node
    assert stage_ranks_per_node(8, 2, 4, "within-nodes") == 2


def test_layout_refusals_name_the_flags():
    with pytest.raises(ConfigError, match=r"^--pp-layout: TrainConfig.pp_layout='diagonal'"):
        TrainConfig(pp=2, grad_accum=2, eval_batches=2, pp_layout="diagonal")
    with pytest.raises(ConfigError, match=r"--pp 4 --pp-layout within-nodes cannot be placed "
                                          r"on nodes of 2 ranks"):
        stage_ranks_per_node(8, 4, 2, "within-nodes")
    with pytest.raises(ConfigError, match=r"--pp 2 --pp-layout across-nodes cannot be placed "
                                          r"on nodes of 3 ranks.*--pp-layout within-nodes"):
        stage_ranks_per_node(8, 2, 3)
    with pytest.raises(ConfigError, match=r"--pp-layout 'x' is invalid"):
        pipeline_coords(0, 4, 2, "x")
    tcfg = TrainConfig(pp=4, grad_accum=4, eval_batches=4, pp_layout="within-nodes")
    with pytest.raises(ConfigError, match=r"--pp-layout within-nodes cannot be placed"):
        check_pipeline(ModelConfig(n_layers=4), tcfg, 8, local=2)
    assert check_pipeline(ModelConfig(n_layers=4), tcfg, 8, local=4) == 2


def test_cli_flag_reaches_the_config():
    from moeflow.commands import train_command as train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--pp", "2", "--grad-accum", "2", "--eval-batches", "2",
                              "--pp-layout", "within-nodes"])
    mcfg, tcfg = train_cmd.configs_from_args(args)
    assert tcfg.pp_layout == "within-nodes"
    train_cmd.check_layout(mcfg, tcfg, 4, 2)
    with pytest.raises(ConfigError, match=r"--pp-layout within-nodes cannot be placed"):
        train_cmd.check_layout(mcfg, tcfg, 6, 3)


def strided_worker(schedule: str) -> dict:
    """PP 2 x EP 2 on 4 ranks as two nodes of 2, the stages strided over the nodes."""
    import torch.distributed as dist

    from moeflow.pipeline_parallel import PipelineRunner, build_pipeline_mesh

    torch.manual_seed(0)
    mesh = build_pipeline_mesh(2, 2, tied_across_ranks=True, local_size=2,
                               layout="within-nodes")
    tcfg = TrainConfig(pp=2, pp_schedule=schedule, grad_accum=cases.N, batch_size=cases.B,
                       ep_size=2, eval_batches=cases.N, pp_layout="within-nodes")
    runner = PipelineRunner(cases.CFG, tcfg, torch.device("cpu"), param_dtype=torch.float64,
                            mesh=mesh)
    val = float(runner.evaluate_batches(cases.eval_batches(runner.dp_rank)))
    x, y = cases.batch(runner.dp_rank)
    stats = runner.forward_backward(x, y)
    norm = runner.sync_and_clip(0.0)
    return {"dp_rank": runner.dp_rank, "pp_rank": mesh.pp_rank,
            "stage_ranks": dist.get_process_group_ranks(mesh.stage.world_group),
            "stage_local": mesh.stage.local_size,
            "grads": {n: p.grad.detach().clone() for n, p in runner.model.named_parameters()
                      if p.grad is not None},
            "stats": stats.tolist(), "norm": float(norm), "val": val}


@pytest.mark.multirank
@pytest.mark.slow       # 17 s; the default run's test_pipeline.py 1f1b case guards the runner
def test_strided_stages_equal_the_unpipelined_step():
    ref = {r["dp_rank"]: r for r in launch_local(cases.reference_worker, 2,
                                                 timeout_s=300).values()}
    res = launch_local(strided_worker, 4, "1f1b", timeout_s=300)
    seen: dict[int, set] = {0: set(), 1: set()}
    for rank, r in res.items():
        assert (r["pp_rank"], r["dp_rank"]) == (rank % 2, rank // 2)
        assert r["stage_ranks"] == [rank % 2, rank % 2 + 2] and r["stage_local"] == 1
        want = ref[r["dp_rank"]]
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, want["grads"][name], rtol=1e-9, atol=1e-12,
                                       msg=name)
        seen[r["dp_rank"]] |= set(r["grads"])
        assert r["stats"] == pytest.approx(want["stats"], rel=1e-12, abs=1e-15)
        assert r["norm"] == pytest.approx(want["norm"], rel=1e-6)
        assert r["val"] == pytest.approx(want["val"], rel=1e-12)
    for dp, names in seen.items():
        assert names == set(ref[dp]["grads"])
