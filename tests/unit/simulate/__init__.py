"""Unit tests of moeflow.simulate."""
