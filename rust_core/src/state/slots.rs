//! `StateSlots`: which recurrent-state slot ids are running sequences' and which hold
//! snapshots.
//!
//! A recurrent state summarizes an exact number of tokens, unlike KV blocks that can be cut
//! anywhere. A snapshot is therefore keyed by the chained hash of the last full block it covers
//! (so it covers exactly `blocks * block_size` tokens), and the engine uses it only when a new
//! prompt's cached KV blocks reach exactly that block. Slot ids `0..running` are running slots,
//! `running..running + snapshots` snapshot slots; the runner allocates them all.

use std::collections::{BTreeMap, HashMap};

use crate::kv::BlockHash;

/// Slot bookkeeping. Pure-attention models use `StateSlots::none()`.
#[derive(Debug)]
pub struct StateSlots {
    free_running: Vec<usize>,
    num_running: usize,
    num_snapshots: usize,
    /// Snapshot key -> (slot, LRU stamp).
    snapshots: HashMap<BlockHash, (usize, u64)>,
    /// LRU stamp -> key, least recently used first.
    lru: BTreeMap<u64, BlockHash>,
    free_snapshot: Vec<usize>,
    next_stamp: u64,
}

impl StateSlots {
    /// `running` slots for sequences and `snapshots` slots for prefix reuse.
    pub fn new(running: usize, snapshots: usize) -> Self {
        StateSlots {
            free_running: (0..running).rev().collect(),
            num_running: running,
            num_snapshots: snapshots,
            snapshots: HashMap::new(),
            lru: BTreeMap::new(),
            free_snapshot: (running..running + snapshots).rev().collect(),
            next_stamp: 0,
        }
    }

    /// No slots: the model has no recurrent state.
    pub fn none() -> Self {
        StateSlots::new(0, 0)
    }

    /// Whether the model needs slots at all.
    pub fn enabled(&self) -> bool {
        self.num_running > 0
    }

    /// Total slot ids the runner must allocate.
    pub fn total(&self) -> usize {
        self.num_running + self.num_snapshots
    }

    /// Free running slots.
    pub fn num_free(&self) -> usize {
        self.free_running.len()
    }

    /// Snapshots currently held.
    pub fn num_snapshots_held(&self) -> usize {
        self.snapshots.len()
    }

    /// Take a running slot.
    pub fn acquire(&mut self) -> Option<usize> {
        self.free_running.pop()
    }

    /// Give a running slot back.
    pub fn release(&mut self, slot: usize) {
        debug_assert!(slot < self.num_running && !self.free_running.contains(&slot));
        self.free_running.push(slot);
    }

    /// The snapshot slot holding the state after the block keyed `hash`, marked recently used.
    pub fn find_snapshot(&mut self, hash: BlockHash) -> Option<usize> {
        let stamp = self.next_stamp;
        let (slot, old) = self.snapshots.get_mut(&hash).map(|e| {
            let old = e.1;
            e.1 = stamp;
            (e.0, old)
        })?;
        self.next_stamp += 1;
        self.lru.remove(&old);
        self.lru.insert(stamp, hash);
        Some(slot)
    }

    /// Whether a snapshot for `hash` exists (without touching the LRU).
    pub fn has_snapshot(&self, hash: BlockHash) -> bool {
        self.snapshots.contains_key(&hash)
    }

    /// Forget the snapshot for `hash` (a sequence replacing its own older snapshot).
    pub fn drop_snapshot(&mut self, hash: BlockHash) {
        if let Some((slot, stamp)) = self.snapshots.remove(&hash) {
            self.lru.remove(&stamp);
            self.free_snapshot.push(slot);
        }
    }

    /// A snapshot slot to copy a state into for key `hash`, evicting the least recently used
    /// snapshot when all are taken. None when a snapshot for `hash` exists or there are no
    /// snapshot slots.
    pub fn reserve_snapshot(&mut self, hash: BlockHash) -> Option<usize> {
        if self.num_snapshots == 0 || self.snapshots.contains_key(&hash) {
            return None;
        }
        let slot = match self.free_snapshot.pop() {
            Some(s) => s,
            None => {
                let (_, victim) = self.lru.pop_first()?;
                self.snapshots.remove(&victim)?.0
            }
        };
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.snapshots.insert(hash, (slot, stamp));
        self.lru.insert(stamp, hash);
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_slots_are_handed_out_once_until_released() {
        let mut s = StateSlots::new(2, 0);
        let a = s.acquire().unwrap();
        let b = s.acquire().unwrap();
        assert_ne!(a, b);
        assert_eq!(s.acquire(), None);
        s.release(a);
        assert_eq!(s.acquire(), Some(a));
    }

    #[test]
    fn snapshots_live_in_their_own_slots_and_evict_least_recently_used() {
        let mut s = StateSlots::new(2, 2);
        let x = s.reserve_snapshot(10).unwrap();
        let y = s.reserve_snapshot(20).unwrap();
        assert!(x >= 2 && y >= 2 && x != y);
        assert_eq!(s.reserve_snapshot(10), None, "one snapshot per key");
        assert_eq!(s.find_snapshot(10), Some(x));
        let z = s.reserve_snapshot(30).unwrap();
        assert_eq!(z, y, "20 was least recently used");
        assert_eq!(s.find_snapshot(20), None);
        assert_eq!(s.find_snapshot(10), Some(x));
        assert_eq!(s.total(), 4);
        s.drop_snapshot(10);
        assert_eq!(s.find_snapshot(10), None);
        assert_eq!(s.reserve_snapshot(40), Some(x), "a dropped snapshot frees its slot");
    }

    #[test]
    fn pure_attention_models_have_no_slots() {
        let mut s = StateSlots::none();
        assert!(!s.enabled());
        assert_eq!(s.reserve_snapshot(1), None);
    }
}
