"""Unit tests of moeflow.placement."""
