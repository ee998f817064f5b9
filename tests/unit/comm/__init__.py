"""Unit tests of moeflow.comm: the exchange and its codecs (ZFP apart, in tests/unit/zfp)."""
