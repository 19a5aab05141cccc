//! sched (filled in by its owner).
