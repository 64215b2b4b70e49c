"""Helpers for running the plugin's tests and simulations on machines without CUDA."""
