"""Measurement core: aligned timing of distributed work and alpha-beta link models.

The layer below the auto-tuner (``moeflow.autotune``), Parm's Algorithm 1 fits
(``moeflow.strategies.parm.fits``, Parm section V) and HECATE's Algorithm 1 cost model
(``moeflow.strategies.fssdp.materialize``, HECATE section 4.2); the benchmark commands (``moeflow.bench``)
build on it. It imports only torch, numpy, the standard library and the leaf modules
``moeflow.errors`` / ``moeflow.devices`` (the device clock and host-side collectives), never the
layer, the schedule or the benchmarks (``tests/unit/core/test_import_layers.py`` checks this).

- :mod:`moeflow.measure.timing`: ranks start a repetition together; a repetition's time is the
  slowest rank's.
- :mod:`moeflow.measure.linkmodel`: ``t = alpha + beta * bytes`` fits (Parm's cost model,
  section 4; ScheMoE's profiler, section 4.2) and their JSON schema ``moeflow.links/1``.
"""
