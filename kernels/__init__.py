"""Bulk pack / unpack of paged KV (installed as `sgl_hicache.kernels`)."""
