"""Tests of benchmarks/deepspeed/."""
