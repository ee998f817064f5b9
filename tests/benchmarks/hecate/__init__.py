"""Tests of benchmarks/hecate/."""
