"""Pipeline parallelism for ``moeflow train --pp N --pp-schedule S`` on
``torch.distributed.pipelining`` (GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B,
Narayanan et al. 2021; ZB-V, Qi et al. 2024; DualPipeV, DeepSeek-V3 Section 3.2.1): the GPT cut
into stages by blocks, each stage expert parallel over its own ranks (docs/training.md,
"Pipeline parallelism")."""

from moeflow.pipeline_parallel.layout_checks import check_pipeline
from moeflow.pipeline_parallel.mesh import PipelineMesh, build_pipeline_mesh, stage_dp_rank
from moeflow.pipeline_parallel.runner import PipelineRunner

__all__ = ["PipelineMesh", "PipelineRunner", "build_pipeline_mesh", "check_pipeline",
           "stage_dp_rank"]
