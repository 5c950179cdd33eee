"""The CPU profile (distribution `sgl-hicache-cpu`, installed by `make setup`): what runs sglang
0.5.23 on a machine without a GPU, for development, CI, `make demo` and the CPU benchmarks.

sgl_kernel_cpu_shim / cpu_shim_hook / install_cpu_shim   an sgl_kernel stand-in where no build exists
cpu_tp_platform / cpu_tp_env                             `--device cpu --tp-size N`
hicache_cpu_compat                                       sglang's own HiCache on CPU (the bench's peer)
page_first_direct                                        its two page_first_direct copies (mooncake L3)
cpu_prefix_attention                                     extend attention over the new rows only
plugin                                                   applies the last two where asked (env)

The runtime (`sgl_hicache`) imports nothing of this package but `cpu_tp_env`, by name, when a CPU
server asks for tensor parallelism (`sgl_hicache.launch_server`).
"""
