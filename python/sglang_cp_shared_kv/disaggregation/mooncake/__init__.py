"""The mooncake connector of a shared-KV prefill server (``conn.py``)."""
