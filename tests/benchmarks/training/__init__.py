"""Tests of benchmarks/training/."""
