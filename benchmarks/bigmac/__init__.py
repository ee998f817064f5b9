"""BigMac (descend-communicate-communicate-ascend experts) reproduced: the structures' layer time
and all-to-all bytes, started as ``moeflow bench bigmac`` and ``moeflow bench curves``."""
