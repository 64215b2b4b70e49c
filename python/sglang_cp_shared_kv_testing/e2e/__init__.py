"""End-to-end smoke support for ``sglang serve`` with NSA prefill CP, shared KV and HiCache.

The pieces that do not need GPUs live here so CPU tests can exercise them: the tiny GLM-5 model
directory, the request plan, Prometheus and server-log parsing, output comparison, and the
``sglang serve`` process wrapper. ``scripts/glm5_cp_hicache_smoke.py`` drives them.
"""
