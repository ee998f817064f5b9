"""CPU checks of the CUDA paths and of the GPU suite's machinery (no GPU needed)."""
