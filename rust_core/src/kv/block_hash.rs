//! Chained block hashes: the key of a full block in the prefix cache is the hash of (the
//! previous block's key, this block's token ids), so equal keys mean equal whole prefixes.

use std::hash::{Hash, Hasher};

/// Key of one full block (and of the whole prefix that ends with it).
pub type BlockHash = u64;

/// Key of a block given its parent's key (`None` for the first block) and its tokens.
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    // SipHash with fixed keys: stable within and across runs of this build.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Keys of every full block of `tokens`, in order.
pub fn chain_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let h = block_hash(parent, chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_blocks_after_different_prefixes_hash_differently() {
        let a = chain_hashes(&[1, 2, 3, 4], 2);
        let b = chain_hashes(&[9, 2, 3, 4], 2);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1]);
        assert_eq!(a, chain_hashes(&[1, 2, 3, 4, 5], 2));
    }
}
