"""Unit tests of moeflow.experts."""
