"""Block kernels and the arithmetic around them, device-free: the math kernel (the CPU backend's, and the
fallback of others) with its mask builder, and the log-sum-exp merge. The base class for fused vendor
kernels, with its mask tiling, is :mod:`xcp.backends.fused`."""
