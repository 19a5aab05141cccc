//! Host <-> device copies in the device's storage type.
//!
//! Checkpoints are bf16 (or f32); a device whose storage is f16 (sm_7x) needs every tensor
//! converted on the way in. Keeping that conversion here (per element, for the loader in
//! `model::cuda_load`, and per tensor) means weights go up the same way on every GPU.
//!
//! `PinnedRing` stages the per-step copies (metadata up, sampled tokens down) through
//! page-locked memory, so that a copy queued behind running work returns at once.

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use super::device::{driver_err, CudaDevice};
use super::kernels::StorageDType;
use crate::Result;

/// One bf16 bit pattern as a `storage` bit pattern: unchanged for bf16, rounded to the nearest
/// f16 for f16 (magnitudes above 65504 become infinities, which an f16 model cannot hold).
#[inline]
pub fn storage_bit_from_bf16(bits: u16, storage: StorageDType) -> u16 {
    match storage {
        StorageDType::Bf16 => bits,
        StorageDType::F16 => half::f16::from_f32(half::bf16::from_bits(bits).to_f32()).to_bits(),
    }
}

/// One f32 value as a `storage` bit pattern (round to nearest even).
#[inline]
pub fn storage_bit_from_f32(value: f32, storage: StorageDType) -> u16 {
    match storage {
        StorageDType::Bf16 => half::bf16::from_f32(value).to_bits(),
        StorageDType::F16 => half::f16::from_f32(value).to_bits(),
    }
}

/// bf16 bit patterns as `storage` bit patterns (`storage_bit_from_bf16`).
pub fn storage_bits_from_bf16(bits: &[u16], storage: StorageDType) -> Vec<u16> {
    bits.iter().map(|&b| storage_bit_from_bf16(b, storage)).collect()
}

/// f32 values as `storage` bit patterns (round to nearest even).
pub fn storage_bits_from_f32(values: &[f32], storage: StorageDType) -> Vec<u16> {
    values.iter().map(|&v| storage_bit_from_f32(v, storage)).collect()
}

/// `storage` bit patterns as f32 values.
pub fn f32_from_storage_bits(bits: &[u16], storage: StorageDType) -> Vec<f32> {
    match storage {
        StorageDType::Bf16 => bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
        StorageDType::F16 => bits.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
    }
}

impl CudaDevice {
    /// Uploads a bf16 tensor (raw bits, as in safetensors) in this device's storage type.
    pub fn upload_bf16(&self, bits: &[u16]) -> Result<CudaSlice<u16>> {
        let host = storage_bits_from_bf16(bits, self.storage());
        self.stream().clone_htod(&host).map_err(driver_err("uploading a bf16 tensor"))
    }

    /// Uploads f32 values rounded to this device's storage type.
    pub fn upload_f32_as_storage(&self, values: &[f32]) -> Result<CudaSlice<u16>> {
        let host = storage_bits_from_f32(values, self.storage());
        self.stream().clone_htod(&host).map_err(driver_err("uploading an f32 tensor"))
    }

    /// Downloads a storage-type buffer as f32 (waits for the stream).
    pub fn download_as_f32(&self, buf: &impl DevicePtr<u16>) -> Result<Vec<f32>> {
        let bits = self.stream().clone_dtoh(buf).map_err(driver_err("downloading a tensor"))?;
        Ok(f32_from_storage_bits(&bits, self.storage()))
    }
}

/// Page-locked host buffers used in turn, each with an event recorded after its last copy:
/// an upload from pageable memory may wait for the work queued before it (the driver stages it)
/// and a download into pageable memory always does, so a step queued while the one before runs
/// (asynchronous scheduling) copies through these instead. A buffer is reused only after its
/// event (the copy of `depth` turns ago) has completed, so a staged copy the device has not
/// done yet is never overwritten.
pub struct PinnedRing<T> {
    bufs: Vec<Option<(PinnedHostSlice<T>, CudaEvent)>>,
    next: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> PinnedRing<T> {
    /// A ring of `depth` buffers, allocated on first use.
    pub fn new(depth: usize) -> Self {
        PinnedRing { bufs: (0..depth.max(1)).map(|_| None).collect(), next: 0 }
    }

    /// The next buffer, holding at least `len` elements, once its last copy is done.
    fn take(&mut self, dev: &CudaDevice, len: usize) -> Result<usize> {
        let i = self.next;
        self.next = (self.next + 1) % self.bufs.len();
        if let Some((_, done)) = &self.bufs[i] {
            done.synchronize().map_err(driver_err("waiting for a staging buffer"))?;
        }
        if self.bufs[i].as_ref().is_none_or(|(b, _)| b.len() < len) {
            self.bufs[i] = None;
            let ctx = dev.context();
            // SAFETY: every element is written (upload) or copied into (download) before it is read.
            let host = unsafe { ctx.alloc_pinned_with_flags::<T>(len.next_power_of_two().max(16), 0) }.map_err(driver_err("allocating pinned staging"))?;
            let done = ctx.new_event(None).map_err(driver_err("creating a staging event"))?;
            self.bufs[i] = Some((host, done));
        }
        Ok(i)
    }

    /// Queue the copy of `host` into the start of `dst` (at least as long).
    pub fn upload(&mut self, dev: &CudaDevice, host: &[T], dst: &mut impl DevicePtrMut<T>) -> Result<()> {
        assert!(dst.len() >= host.len(), "upload of {} elements into {}", host.len(), dst.len());
        let i = self.take(dev, host.len())?;
        let (buf, done) = self.bufs[i].as_mut().expect("taken above");
        let staged = &mut buf.as_mut_slice().map_err(driver_err("writing pinned staging"))?[..host.len()];
        staged.copy_from_slice(host);
        let stream = dev.stream();
        let (ptr, _record) = dst.device_ptr_mut(stream);
        // SAFETY: `staged` is page-locked and stays allocated and unwritten until `done` (recorded
        // right after this copy) completes: `take` waits for it before handing the buffer out.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, staged, stream.cu_stream()) }.map_err(driver_err("uploading through pinned staging"))?;
        done.record(stream).map_err(driver_err("recording a staging event"))
    }

    /// Queue the copy of `src` into a buffer of the ring; returns the buffer's index for
    /// `downloaded`, valid until `depth` more copies are queued.
    pub fn download(&mut self, dev: &CudaDevice, src: &impl DevicePtr<T>) -> Result<usize> {
        let n = src.len();
        let i = self.take(dev, n)?;
        let (buf, done) = self.bufs[i].as_mut().expect("taken above");
        let staged = &mut buf.as_mut_slice().map_err(driver_err("reading pinned staging"))?[..n];
        let stream = dev.stream();
        let (ptr, _record) = src.device_ptr(stream);
        // SAFETY: as in `upload`; the host reads `staged` only after `done` completes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(staged, ptr, stream.cu_stream()) }.map_err(driver_err("downloading through pinned staging"))?;
        done.record(stream).map_err(driver_err("recording a staging event"))?;
        Ok(i)
    }

    /// The first `n` elements of buffer `i` once its copy is done (waits for it).
    pub fn downloaded(&self, i: usize, n: usize) -> Result<&[T]> {
        let (buf, done) = self.bufs.get(i).and_then(Option::as_ref).ok_or_else(|| crate::NinferError::Device(format!("no staging buffer {i}")))?;
        done.synchronize().map_err(driver_err("waiting for a download"))?;
        Ok(&buf.as_slice().map_err(driver_err("reading pinned staging"))?[..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_bits_pass_through_for_bf16_storage() {
        let bits: Vec<u16> = [1.5f32, -3.25, 1e30].iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        assert_eq!(storage_bits_from_bf16(&bits, StorageDType::Bf16), bits);
    }

    #[test]
    fn bf16_converts_to_the_nearest_f16_and_saturates_to_infinity() {
        let vals = [1.5f32, -3.25, 0.1, 1e30];
        let bits: Vec<u16> = vals.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let f16 = f32_from_storage_bits(&storage_bits_from_bf16(&bits, StorageDType::F16), StorageDType::F16);
        assert_eq!(f16[0], 1.5);
        assert_eq!(f16[1], -3.25);
        assert!((f16[2] - 0.1).abs() < 1e-3);
        assert!(f16[3].is_infinite());
    }

    #[test]
    fn f32_round_trips_through_storage_within_its_precision() {
        let vals = [0.3f32, -7.7, 123.456];
        for st in [StorageDType::Bf16, StorageDType::F16] {
            let back = f32_from_storage_bits(&storage_bits_from_f32(&vals, st), st);
            for (a, b) in vals.iter().zip(&back) {
                assert!(((a - b) / a).abs() < 4e-3, "{st:?}: {a} -> {b}");
            }
        }
    }
}
