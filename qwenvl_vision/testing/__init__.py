"""What the benchmarks (``bench/``) and the tests share, as ``torch.testing`` is for torch: transformers' towers as
the numerical reference with the errors measured against them (``reference``, which needs the ``test`` extra's
transformers), and the inputs they are measured on (``workloads``). ``import qwenvl_vision`` does not import it.
"""
