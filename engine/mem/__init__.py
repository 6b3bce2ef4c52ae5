"""Memory: the page allocator, the paged KV pool and the prefix caches built on them."""
