"""Unit tests of moeflow.cluster."""
