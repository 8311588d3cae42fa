"""The CPU inference backend: a forward that runs the modules' math on the kernels the machine at hand measured.

``plan`` measures and caches the machine's choices, ``packing`` puts the weights in the layouts they chose,
``forward`` runs a tower's blocks and mergers on them through a ``workspace``; ``kernels`` holds the oneDNN and
GEMM-attention kernels. The model core (``layers``, ``tower``) never reads any of it: the tower picks this
execution or the modules' own once per forward.
"""
