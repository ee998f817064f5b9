"""Harnesses that drive peer MoE implementations (DeepSpeed-MoE) against moeflow. Outside the
package: moeflow never imports them (``tests/unit/core/test_import_layers.py``); run them from the
repository root (``python -m benchmarks.deepspeed.parm_deepspeed_trace``), or through
``moeflow bench parm --compare deepspeed`` from a source checkout."""
