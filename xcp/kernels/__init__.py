"""Block kernels and the arithmetic around them, device-free: the math kernel (the CPU backend's, and the
fallback of others), the mask tiling that lets fused kernels serve any mask, the log-sum-exp merge, and a
base class for backends whose kernel is a fused vendor op."""
