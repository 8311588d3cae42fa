"""The CPU inference backend: a forward that runs the modules' math on the kernels the machine at hand measured.

``backend`` is what a tower on the CPU asks once per call (``CpuBackend``, attached by ``use_cpu_kernels`` only
where a tower is on the CPU: the setting, the plan, the packing, the per-call workspace); ``plan`` holds the choices,
``probes`` time them on the machine at hand, ``machine`` keeps them per machine, ``packing`` puts the weights in the
layouts they chose, ``forward`` runs a tower's blocks and mergers on them through a ``workspace``; ``kernels`` holds
the oneDNN and GEMM-attention kernels. The model (``qwenvl_vision.model``) never imports any of it.
"""
