//! Activation arena: one device allocation sized for the largest step, carved into the
//! per-step temporaries, so that a decode step allocates nothing (and can be captured in a
//! CUDA graph). The memory ledger reserves `capacity` bytes for it up front.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};

use super::device::{driver_err, CudaDevice};
use crate::{NinferError, Result};

/// Alignment of every region, enough for 16-byte vector access and cuBLAS.
pub const ARENA_ALIGN: usize = 256;

/// A fixed-size device buffer handed out as disjoint, aligned regions.
pub struct ActivationArena {
    buf: CudaSlice<u8>,
    base: u64,
}

/// Bytes that regions of these byte lengths take in an arena, alignment padding included.
pub fn arena_bytes(lens: &[usize]) -> usize {
    lens.iter().map(|l| l.div_ceil(ARENA_ALIGN) * ARENA_ALIGN).sum()
}

/// A typed region of the arena. It derefs to a `CudaSlice<T>` (so every op takes it) that does
/// not own its memory; the borrow of the arena keeps the region from outliving a reset.
pub struct ArenaRegion<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    _arena: PhantomData<&'a mut ActivationArena>,
}

impl<T> Deref for ArenaRegion<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for ArenaRegion<'_, T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for ArenaRegion<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken exactly once, here; leak() gives the memory back to the
        // arena instead of freeing it.
        let s = unsafe { ManuallyDrop::take(&mut self.slice) };
        s.leak();
    }
}

impl ActivationArena {
    /// Allocates `capacity` bytes on `device`.
    pub fn new(device: &CudaDevice, capacity: usize) -> Result<Self> {
        // SAFETY: regions are written by kernels before they are read; nothing reads the
        // uninitialised bytes.
        let buf = unsafe { device.stream().alloc::<u8>(capacity.max(ARENA_ALIGN)) }
            .map_err(driver_err("allocating the activation arena"))?;
        let base = buf.device_ptr(device.stream()).0;
        Ok(ActivationArena { buf, base })
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Splits the arena into `lens.len()` regions of `lens[i]` elements of `T`, each starting
    /// on an `ARENA_ALIGN` boundary, valid until the arena is borrowed again. Fails with the
    /// shortfall in bytes when they do not fit.
    pub fn regions<T: DeviceRepr>(
        &mut self,
        device: &CudaDevice,
        lens: &[usize],
    ) -> Result<Vec<ArenaRegion<'_, T>>> {
        let elem = std::mem::size_of::<T>();
        let bytes: Vec<usize> = lens.iter().map(|l| l * elem).collect();
        let needed = arena_bytes(&bytes);
        if needed > self.buf.len() {
            return Err(NinferError::OutOfMemory {
                what: "the activation arena".into(),
                needed: needed as u64,
                available: self.buf.len() as u64,
                hint: "the step is larger than the arena was sized for; lower prefill_chunk or \
                       max_concurrency"
                    .into(),
            });
        }
        let mut offset = 0usize;
        let mut out = Vec::with_capacity(lens.len());
        for (&len, &b) in lens.iter().zip(&bytes) {
            // SAFETY: [base + offset, base + offset + b) lies inside `buf` (checked above),
            // regions are disjoint, and each is leaked (not freed) when dropped.
            let slice = unsafe { device.stream().upgrade_device_ptr::<T>(self.base + offset as u64, len) };
            out.push(ArenaRegion { slice: ManuallyDrop::new(slice), _arena: PhantomData });
            offset += b.div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        }
        Ok(out)
    }
}
