"""A request's pages: admission (prefix match + allocation), growth, caching into the prefix cache, release.

Invariant: ``req.pages[:req.num_cached_pages]`` belong to the prefix cache and are locked through ``req.node``;
the rest are the request's own and are freed (or handed to the cache) when it leaves."""
from __future__ import annotations

from engine.mem.allocator import PageAllocator
from engine.mem.base import MatchResult, PrefixCache
from engine.request import Request


PREFIX_LOADS = 2  # load-backs one request may start: a prefix evicted again before admission is then recomputed


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class KVManager:
    def __init__(self, allocator: PageAllocator, cache: PrefixCache, page_size: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size

    @staticmethod
    def _key(req: Request) -> list[int]:
        # prompt logprobs need every prompt position's logits: nothing may come from the cache
        return [] if req.sampling.prompt_logprobs is not None else req.tokens(0, req.seq_len - 1)

    def cached_length(self, req: Request) -> int:
        """What the cache's tiers hold of ``req``'s prompt (shared store aside), changing nothing."""
        return self.cache.cached_length(self._key(req), req.extra_key)

    def match(self, req: Request, load: bool = False) -> MatchResult:
        """Longest cached prefix, leaving at least one token to compute (its logits give the next token). With
        ``load``, the part of it in a lower cache tier is copied into the pool first, here (HiCache)."""
        match = self.cache.match_prefix(self._key(req), req.extra_key)
        if load and match.pending:  # another request's load brings part of it: wait for that too
            self.cache.finish_loads(wait=True)
            match = self.cache.match_prefix(self._key(req), req.extra_key)
        return self.cache.load_back(match) if load and match.host_tokens else match

    def match_or_load(self, req: Request, inline_under_s: float = 0.0) -> MatchResult | None:
        """The longest cached prefix, or None while part of it is being loaded from a lower tier in the
        background (a load this starts, or another request's): ask again at the next admission. A load from the
        host tier expected to take under ``inline_under_s`` is copied here instead, and the match includes it."""
        match = self.cache.match_prefix(self._key(req), req.extra_key)
        if match.pending:
            return None
        if match.host_tokens and req.prefix_loads < PREFIX_LOADS:
            req.prefix_loads += 1
            return self.cache.start_load(match, inline_under_s)
        return match

    def reserve(self, pages: int) -> bool:
        """Make ``pages`` free pages available, evicting unlocked cache entries if needed."""
        short = pages - self.allocator.available
        if short > 0:
            self.cache.evict(short * self.page_size)
        return self.allocator.available >= pages

    def admit(self, req: Request, match: MatchResult, headroom_pages: int = 0) -> bool:
        """Lock the matched prefix and allocate pages for the rest of the sequence; False if memory is short."""
        need = pages_for(req.seq_len, self.page_size) - len(match.pages)
        self.cache.inc_lock(match.node)  # protect the match from the eviction reserve() may do
        if not self.reserve(need + headroom_pages):
            self.cache.dec_lock(match.node)
            return False
        new = self.allocator.alloc(need)
        assert new is not None
        req.pages = match.pages + new
        req.num_cached_pages = len(match.pages)
        req.node = match.node
        req.kv_len = match.num_tokens
        if req.cached_tokens is None:
            req.cached_tokens = match.num_tokens
        return True

    def grow(self, req: Request, tokens: int, evict: bool = True) -> bool:
        """Ensure pages for ``tokens`` more positions after kv_len (without ``evict``: from free pages only)."""
        need = pages_for(req.kv_len + tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not (self.reserve(need) if evict else self.allocator.available >= need):
            return False
        new = self.allocator.alloc(need)
        assert new is not None
        req.pages.extend(new)
        return True

    def trim(self, req: Request) -> None:
        """Free the pages past the one the request's next token goes to (grown for drafts it did not keep)."""
        keep = max(pages_for(req.seq_len, self.page_size), req.num_cached_pages)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def cache_prefix(self, req: Request) -> None:
        """Hand the computed whole pages to the prefix cache and lock them (called when prefill completes)."""
        if not self.cache.enabled:
            return
        full = req.kv_len // self.page_size
        if full <= req.num_cached_pages:
            return
        key = req.tokens(0, full * self.page_size)
        dup = self.cache.insert(key, req.pages[:full], req.extra_key, req.priority)
        self.allocator.free(req.pages[req.num_cached_pages:dup // self.page_size])
        match = self.cache.match_prefix(key, req.extra_key)
        assert len(match.pages) == full, "pages just inserted must match"
        self.cache.inc_lock(match.node)
        self.cache.dec_lock(req.node)
        req.pages[:full] = match.pages
        req.num_cached_pages = full
        req.node = match.node

    def release(self, req: Request, keep: bool = True) -> None:
        """Give back every page: whole computed pages go to the prefix cache when ``keep``, the rest are freed."""
        if self.cache.enabled and keep:
            self.cache_prefix(req)
        self.allocator.free(req.pages[req.num_cached_pages:])
        self.cache.dec_lock(req.node)
        req.pages = []
        req.num_cached_pages = 0
        req.node = None
        req.kv_len = 0
