//! Recurrent-state slots for hybrid (Gated DeltaNet) models: one slot per running sequence,
//! plus LRU snapshot slots that make prefix reuse possible for them.

pub mod slots;

pub use slots::StateSlots;
