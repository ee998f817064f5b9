"""Unit tests of moeflow.routing."""
