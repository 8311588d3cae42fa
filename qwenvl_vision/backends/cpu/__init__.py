"""The CPU inference backend: a forward that runs the modules' math on the kernels the machine at hand measured.

``plan`` holds the choices, ``machine`` measures them on the machine at hand and caches them per machine,
``packing`` puts the weights in the layouts they chose,
``forward`` runs a tower's blocks and mergers on them through a ``workspace``; ``kernels`` holds the oneDNN and
GEMM-attention kernels. The modules (``layers``) never read any of it: the tower picks this execution or the
modules' own once per call.
"""
