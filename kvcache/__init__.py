"""Everything about cached KV, behind one ``KVCacheManager``.

Pure Python except ``kvcache.payloads``, which only the engine thread imports.
"""
