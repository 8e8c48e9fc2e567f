"""Pure-Python scheduling: request lifecycle, admission against a memory budget,
the batch policy and the async streams handlers read. Imports no mlx."""
