"""Tests of the paper benchmarks under benchmarks/ (outside the moeflow package)."""
