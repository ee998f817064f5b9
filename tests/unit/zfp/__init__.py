"""Unit tests of moeflow.comm.codecs.zfp: every ZFP back end against zfpy and the reference coder."""
