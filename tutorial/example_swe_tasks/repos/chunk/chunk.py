def chunk(items, size):
    """Split items into consecutive lists of length size (the last one may be shorter)."""
    return [items[i:i + size] for i in range(1, len(items), size)]
