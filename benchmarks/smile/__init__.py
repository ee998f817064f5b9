"""SMILE (bi-level routing) reproduced: bi-level vs flat top-1 routing on several nodes, started
as ``moeflow bench smile``."""
