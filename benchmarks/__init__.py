"""The papers' experiments reproduced, and the harnesses that drive peer MoE implementations
(DeepSpeed-MoE) against moeflow: one folder per paper (hecate/, parm/, smile/, bigmac/,
deepseek_v3/, training/, deepspeed/). Outside the package: moeflow never imports them
(``tests/unit/core/test_import_layers.py``). Each paper folder's ``commands.py`` registers its
``moeflow bench NAME`` subcommands, which the CLI finds by path in a source checkout
(``moeflow/commands/bench_papers.py``); the DeepSpeed tracer runs under DeepSpeed's own Python
from the repository root (``python -m benchmarks.deepspeed.parm_deepspeed_trace``); the
torchtitan and Megatron-core runners (``peers/``) run under their own venvs' interpreters,
started by ``moeflow bench layer --compare torchtitan|megatron``."""
