//! `BlockPool`: refcounted KV blocks with a prefix cache keyed by chained block hashes.
//!
//! A block is either in use (refcount > 0) or free. Free blocks sit in an LRU queue; a free block
//! that still holds a cached full block keeps its hash until the block is handed out again
//! (evicted), so a later request with the same prefix can take it back without recomputing.

use std::collections::{BTreeMap, HashMap};

use super::BlockHash;

#[derive(Clone, Debug, Default)]
struct Block {
    ref_count: u32,
    /// Key and tokens of the full block it caches (tokens guard against hash collisions).
    cached: Option<(BlockHash, Vec<u32>)>,
    /// Position in the free LRU while free.
    free_stamp: Option<u64>,
}

/// Bookkeeping over `num_blocks` blocks of `block_size` tokens.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free blocks, least recently freed first.
    free_lru: BTreeMap<u64, u32>,
    next_stamp: u64,
    by_hash: HashMap<BlockHash, u32>,
    /// Prefix-cache hits, in tokens, since start.
    pub hit_tokens: u64,
}

impl BlockPool {
    /// All blocks start free and uncached.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut pool = BlockPool {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free_lru: BTreeMap::new(),
            next_stamp: 0,
            by_hash: HashMap::new(),
            hit_tokens: 0,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free(id);
        }
        pool
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.free_lru.len()
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.free_lru.len()
    }

    /// Blocks whose refcount is `id`'s (tests and invariants).
    pub fn ref_count(&self, id: u32) -> u32 {
        self.blocks[id as usize].ref_count
    }

    /// The cached block holding exactly `tokens` under key `hash`, if any.
    pub fn lookup(&self, hash: BlockHash, tokens: &[u32]) -> Option<u32> {
        let id = *self.by_hash.get(&hash)?;
        match &self.blocks[id as usize].cached {
            Some((h, t)) if *h == hash && t == tokens => Some(id),
            _ => None,
        }
    }

    /// Take a reference on a cached block found by `lookup` (a prefix hit).
    pub fn acquire_cached(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if let Some(stamp) = b.free_stamp.take() {
            self.free_lru.remove(&stamp);
        }
        b.ref_count += 1;
        self.hit_tokens += self.block_size as u64;
    }

    /// Hand out the least recently freed block (evicting what it cached), refcount 1.
    pub fn allocate(&mut self) -> Option<u32> {
        let (_, id) = self.free_lru.pop_first()?;
        let b = &mut self.blocks[id as usize];
        b.free_stamp = None;
        b.ref_count = 1;
        if let Some((h, _)) = b.cached.take() {
            if self.by_hash.get(&h) == Some(&id) {
                self.by_hash.remove(&h);
            }
        }
        Some(id)
    }

    /// Drop one reference; at zero the block becomes free but keeps its cached contents.
    pub fn free(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_count > 0, "double free of block {id}");
        b.ref_count = b.ref_count.saturating_sub(1);
        if b.ref_count == 0 {
            self.push_free(id);
        }
    }

    /// Drop one reference on each block, last block first, so that the tail of a sequence is
    /// evicted before its (more shareable) head.
    pub fn free_all(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.free(id);
        }
    }

    /// Register a block whose tokens are all computed as the cached block for `hash`. A key
    /// that is already cached keeps its existing block.
    pub fn register_full(&mut self, id: u32, hash: BlockHash, tokens: &[u32]) {
        if self.by_hash.contains_key(&hash) || self.blocks[id as usize].cached.is_some() {
            return;
        }
        self.blocks[id as usize].cached = Some((hash, tokens.to_vec()));
        self.by_hash.insert(hash, id);
    }

    /// Forget every cached block (used when prefix reuse is turned off mid-run or by tests).
    pub fn clear_cache(&mut self) {
        for b in &mut self.blocks {
            b.cached = None;
        }
        self.by_hash.clear();
    }

    fn push_free(&mut self, id: u32) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.blocks[id as usize].free_stamp = Some(stamp);
        self.free_lru.insert(stamp, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::chain_hashes;

    #[test]
    fn allocate_until_empty_then_free_returns_blocks() {
        let mut p = BlockPool::new(3, 4);
        let ids: Vec<u32> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(p.allocate(), None);
        assert_eq!(p.num_used(), 3);
        p.free_all(&ids);
        assert_eq!(p.num_free(), 3);
    }

    #[test]
    fn cached_block_is_found_after_free_and_refcounted_on_hit() {
        let mut p = BlockPool::new(4, 2);
        let toks = [5, 6, 7, 8];
        let h = chain_hashes(&toks, 2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.register_full(a, h[0], &toks[..2]);
        p.register_full(b, h[1], &toks[2..]);
        assert_eq!(p.lookup(h[0], &toks[..2]), Some(a));
        p.acquire_cached(a);
        assert_eq!(p.ref_count(a), 2);
        p.free_all(&[a, b]);
        p.free(a);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.lookup(h[1], &toks[2..]), Some(b));
        p.acquire_cached(b);
        assert_eq!(p.num_free(), 3);
        assert_eq!(p.hit_tokens, 4);
        assert_eq!(p.lookup(h[1], &[0, 0]), None, "tokens must match, not only the hash");
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_block_first() {
        let mut p = BlockPool::new(2, 1);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.register_full(a, 100, &[1]);
        p.register_full(b, 200, &[2]);
        p.free(b);
        p.free(a);
        let c = p.allocate().unwrap();
        assert_eq!(c, b);
        assert_eq!(p.lookup(200, &[2]), None);
        assert_eq!(p.lookup(100, &[1]), Some(a));
    }

    #[test]
    fn registering_an_already_cached_hash_keeps_the_first_block() {
        let mut p = BlockPool::new(2, 1);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.register_full(a, 1, &[3]);
        p.register_full(b, 1, &[3]);
        assert_eq!(p.lookup(1, &[3]), Some(a));
        p.free(b);
        p.allocate().unwrap();
        assert_eq!(p.lookup(1, &[3]), Some(a), "evicting the duplicate must not drop the original");
    }
}
