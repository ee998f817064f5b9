"""HECATE (FSSDP, sparse all-gather / reduce-scatter, re-materialization) reproduced: Sections
3-5's layer, transport and end-to-end experiments, started as ``moeflow bench hecate``,
``spag``, ``spag-overlap``, ``hecate-model``, ``hecate-fit`` and ``hecate-train``."""
