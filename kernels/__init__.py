"""Attention kernels. Kept free of imports: transformers probes a package named `kernels`."""
