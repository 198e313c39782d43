"""The KV cache: preallocated slot-based or paged storage, sized from a memory budget, and the host's bookkeeping of a paged cache's blocks."""
