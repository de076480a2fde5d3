"""Paged KV cache: host allocator (pages.py, L0) and device page pools (kv.py, L3)."""
