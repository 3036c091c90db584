"""numa-moe: NUMA-aware placement toolkit and CPU kernels for Mixture-of-Experts inference.

Floors, bottom up; a module imports only from its own floor or the floors below it
(docs/architecture.md, "Package layout"):

* ``formats``, ``files``, ``arrays``, ``quant`` - the one table of dtypes, weight formats
  and groups; reading the files users name; bf16 / index views of user arrays; the
  group-wise INT8 / INT4 format math
* ``placement`` - ``pages``, ``topology``, ``memory`` (interleaved allocation, page maps),
  ``segments`` (the periodic page-to-node segment table), ``tables``
* ``checkpoints`` - one reader per file format (``safetensors``, ``gguf``, ``fp8``), the
  expert ``naming``, the ``writer``, ``expert_import``, ``quantize``, ``synthetic``, and
  ``dispatch.open_checkpoint`` on top
* ``layer`` - ``kernels``, ``store`` (ExpertStore), ``pools``, ``registry``,
  ``moe_layer`` (MoELayer), ``op`` (torch.ops.numa_moe.moe_forward), ``attention``
* ``integrations`` - transformers (``hf``, ``hf_attention``) and vLLM (``vllm``, ``vllm_check``)
* ``apps`` - the commands' library code: ``run``, ``generate``, ``simulate``,
  ``placement_report``, ``doctor`` and ``doctor_checks``, ``benchmarking``
"""

__version__ = "0.1.0"


def __getattr__(name):
    # numa_moe.MoELayer without importing the native layer (or torch) at package import
    if name == "MoELayer":
        from numa_moe.layer.moe_layer import MoELayer

        return MoELayer
    raise AttributeError(f"module 'numa_moe' has no attribute {name!r}")
