"""Unit tests of moeflow.measure."""
