"""Tests of benchmarks/parm/."""
