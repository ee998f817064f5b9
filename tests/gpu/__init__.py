"""Tests that need CUDA (marked ``gpu``; skip without it, see docs/gpu.md)."""
