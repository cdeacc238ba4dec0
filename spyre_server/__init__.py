"""spyre-server: the HTTP layer, engine and model runner (DESIGN.md §2)."""
