"""sgl_hicache: an NVMe / NVMe-oF spill tier for SGLang's radix cache.

Importing this package is cheap (no torch, no sglang): the heavy modules are imported by the
pieces that need them.
"""

__version__ = "0.1.0"
BACKEND_NAME = "hicache_spill"  # the radix-cache backend we register with sglang (`--radix-cache-backend`)
