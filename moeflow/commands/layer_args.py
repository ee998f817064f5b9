"""The arguments of ``moeflow bench layer`` (one MoE layer's forward + backward split by phase,
ScheMoE Section 4's layer), which ``moeflow simulate layer`` takes too, so that a prediction and
a measurement compare row by row."""

from __future__ import annotations

import argparse

from moeflow.commands.common import add_device_arg, add_launch_args


def add_layer_args(layer: argparse.ArgumentParser) -> None:
    """The arguments of ``moeflow bench layer``; ``moeflow simulate layer`` takes the same ones,
    so that a prediction and a measurement compare one to one."""
    layer.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    layer.add_argument("--d-model", type=int, default=256, help="model width (d_model)")
    layer.add_argument("--d-expert", type=int, default=512, help="hidden width of each expert")
    layer.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    layer.add_argument("--reps", type=int, default=7, help="timed steps (the median is reported)")
    layer.add_argument("--schedules", default="sequential",
                       help="comma-separated schedules: each besides sequential adds a GShard "
                            "top-2 row at --pipeline-degree (e.g. sequential,pipelined,optsche)")
    layer.add_argument("--pipeline-degree", type=int, default=2,
                       help="r of the pipelined rows")
    layer.add_argument("--algorithms", default="direct",
                       help="comma-separated all-to-all algorithms (MoEConfig.a2a), or "
                            "node_dedup / auto (MoEConfig.placement; auto: the tuner picks "
                            "direct or node_dedup, untimed, before the warm-up): every config "
                            "runs under each (default direct)")
    layer.add_argument("--local-size", type=int, default=None,
                       help="ranks per (emulated) node; the inter_bytes column counts what "
                            "crosses nodes (default: torchrun's LOCAL_WORLD_SIZE, else one node)")
    add_device_arg(layer)
    layer.add_argument("--out", default=None,
                       help="write the results as JSON here (default: print only)")
    # one layer side by side with a peer implementation (moeflow/bench/compare.py)
    cmp = layer.add_argument_group("--compare (one GShard-style layer against a peer)")
    cmp.add_argument("--compare", default=None, metavar="PEER",
                     help="time this peer's layer with the same weights, interleaved, check the "
                          "outputs agree and report the ratio: tutel (needs Tutel installed "
                          "from source, see docs/benchmarks/layer.md), moeflow-fixed, or "
                          "torchtitan / megatron (each in a venv of its own: --peer-python)")
    cmp.add_argument("--peer-python", default=None, metavar="PATH",
                     help="--compare torchtitan|megatron: the peer venv's interpreter (built by "
                          "docs/benchmarks/install_torchtitan.sh / install_megatron_core.sh)")
    cmp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                     help="--compare torchtitan|megatron: fp32, or bf16 (moeflow under bf16 "
                          "autocast, the peer's bf16 layer; each side's error against float64 "
                          "is reported)")
    cmp.add_argument("--num-experts", type=int, default=8, help="experts of every row (a multiple of the world) and of --compare")
    cmp.add_argument("--top-k", type=int, default=2, help="experts per token (--compare)")
    cmp.add_argument("--capacity-factor", type=float, default=1.25,
                     help="capacity factor (--compare; 0: dropless, as torchtitan and megatron "
                          "need)")
    cmp.add_argument("--activation", default="gelu", help="expert activation (--compare)")
    cmp.add_argument("--a2a", default="auto", help="moeflow's all-to-all (--compare; default "
                                                   "auto: tuned at the first forward)")
    cmp.add_argument("--schedule", default="auto", help="moeflow's schedule (--compare)")
    cmp.add_argument("--input-grad", action="store_true",
                     help="the layer's input needs its gradient too (--compare; default: "
                          "parameter gradients only)")
    cmp.add_argument("--degree", default="auto",
                     help="moeflow's pipelining degree (--compare; an integer or auto)")
    cmp.add_argument("--codec", default="none",
                     help="MoEConfig.codec of every row (names unchanged, each row records its "
                          "codec), or with --compare moeflow's codec ('auto:lossy' lets the "
                          "tuner pick a lossy codec within --lossy-error-budget, --compare only)")
    cmp.add_argument("--codec-backward", action="store_true",
                     help="MoEConfig.codec_backward: with --codec NAME, compress the backward's "
                          "payloads too (not with --compare)")
    cmp.add_argument("--lossy-error-budget", type=float, default=None,
                     help="MoEConfig.lossy_error_budget with --codec auto:lossy (default 1e-2)")
    cmp.add_argument("--placement", default="ep", choices=("ep", "node_dedup", "auto"),
                     help="moeflow's MoEConfig.placement (--compare): ep (expert parallelism), "
                          "node_dedup (DeepEP's inter-node dispatch) or auto (the tuner's pick "
                          "of the two at the first forward)")
    cmp.add_argument("--autotune-budget", default="30",
                     help="MoEConfig.autotune_budget_s: seconds the tuner may take, or 'none' "
                          "(unbounded) (--compare)")
    add_launch_args(layer, default_nproc=1)
