"""Per-owner NSA decode (the default with ``fa3``; ``SGLANG_CP_SHARED_KV_DECODE``): each CP rank scores and
attends over its own pages only, and a fixed exchange per layer replaces the page gather.

* ``decode_forward``: the per-forward state and the hooks a decode forward runs through (indexer
  metadata, the decode impls' kernel calls), and the startup decision to attach;
* ``owner_decode_tables``: this rank's block table, page columns and owned lengths of a batch;
* ``decode_topk_merge``: local top-k candidates, their exchange and the global selection;
* ``attention_lse_merge``: the merge of the ranks' partial attention outputs by log-sum-exp, in one
  all-gather or the scaled sum's two collectives, and the rule picking one per decode batch;
* ``fused_kernels``: Triton forms of the selection's and the merges' arithmetic (CUDA; the torch
  forms are the reference);
* ``cuda_graphs``: static owner tables refreshed before each decode graph replay.

Which decode path a server takes is decided outside, in ``startup_rules.decide_decode_path``, so
that the startup rules need not import this package.
"""
