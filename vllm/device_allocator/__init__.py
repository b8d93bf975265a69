"""Device memory that sleep mode can hand back and take again at the same addresses (cumem.py)."""
