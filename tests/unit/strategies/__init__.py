"""Unit tests of moeflow.strategies."""
