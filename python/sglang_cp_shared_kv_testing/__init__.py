"""Test support of the plugin, beside the product package: CPU shims of the CUDA kernels, the CP
HiCache stack builders, gloo multi-rank runs, simulations, the served smokes' clients and drivers
(``e2e``). Tests, scripts and benchmarks import it from a checkout (the editable install of the
README puts ``python/`` on the path); a built wheel of the plugin leaves it out."""
