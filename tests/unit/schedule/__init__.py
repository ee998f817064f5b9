"""Unit tests of moeflow.schedule."""
