"""numa-moe: NUMA-aware placement toolkit and CPU kernels for Mixture-of-Experts inference.

Layers, bottom up (each imports only from the layers below it):

* ``pages``     - page-size names ("4k", "2m") and their bytes
* ``topology``  - nodes, CPUs, memory, page sizes, CPU features (real or virtual)
* ``memory``    - interleaved allocation, measured page maps, page migration
* ``segments``  - the periodic page-to-node segment table (pure math, no syscalls)
* ``kernels``   - expert FFN kernels over segment lists (AMX, AVX-512, AVX2, reference)
* ``checkpoint``/``store`` - routed experts of a safetensors checkpoint, loaded interleaved
* ``moe``       - the NUMA-partitioned MoE layer (per-node workers + reduction)
* ``attention`` - GQA decode attention over KV caches split by node (log-sum-exp merge)
* ``generate``  - a transformers decode loop with both kernels (``numa-moe generate``)
"""

__version__ = "0.1.0"


def __getattr__(name):
    # numa_moe.MoELayer without importing the native layer (or torch) at package import
    if name == "MoELayer":
        from numa_moe.layer.moe_layer import MoELayer

        return MoELayer
    raise AttributeError(f"module 'numa_moe' has no attribute {name!r}")
