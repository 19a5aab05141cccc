//! Paged KV bookkeeping: which block ids a sequence owns, and which full blocks can be shared
//! through the prefix cache. Pure host logic; the runner owns the device memory behind the ids.

pub mod block_pool;
pub mod block_hash;

pub use block_hash::{block_hash, chain_hashes, BlockHash};
pub use block_pool::BlockPool;
