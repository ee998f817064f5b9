"""Tests that mostly spawn gloo ranks on this machine (marked ``multirank``)."""
