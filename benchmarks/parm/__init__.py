"""Parm (dedicated MP / ESP schedules S1, S2, Algorithm 1) reproduced: Section V's Table III grid,
the collectives against their alpha-beta predictions, and Table V's training analog, started as
``moeflow bench parm`` and ``moeflow bench parm-train``."""
