"""PD disaggregation with a shared-KV prefill server: each CP rank sends the pages it owns."""
