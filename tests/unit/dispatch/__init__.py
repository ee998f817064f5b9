"""Unit tests of moeflow.dispatch."""
