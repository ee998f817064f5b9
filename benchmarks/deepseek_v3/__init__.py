"""DeepSeek-V3 (Section 2.1.2's node-limited routing) reproduced: inter-node bytes and step time
against plain top-k, started as ``moeflow bench group-limited``."""
