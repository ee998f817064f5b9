"""Unit tests of moeflow.bench."""
