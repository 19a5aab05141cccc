//! HF safetensors checkpoints: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped, converted to f32 on request.
//!
//! Headers are validated when the store opens (a truncated or corrupt file fails there, naming
//! the file); tensors are converted one at a time, so peak memory is the f32 weights plus one
//! mapped file.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::{Dtype, Metadata, SafeTensors};
use memmap2::Mmap;

use crate::{NinferError, Result};

/// One mapped safetensors file with its parsed header.
struct MappedFile {
    path: PathBuf,
    /// Kept open for positioned reads (`RawTensor::read_into`).
    file: File,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// Shape and dtype of a stored tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Dimensions as stored.
    pub shape: Vec<usize>,
    /// safetensors dtype name (`F32`, `BF16`, ...).
    pub dtype: String,
}

/// All tensors of a checkpoint, by name.
pub struct WeightStore {
    files: Vec<MappedFile>,
    /// Tensor name -> index into `files`.
    index: HashMap<String, usize>,
    dir: PathBuf,
}

fn map_file(path: &Path) -> Result<MappedFile> {
    if !path.exists() {
        return Err(NinferError::MissingFile { path: path.to_path_buf(), what: "a safetensors weight file".into() });
    }
    let file = File::open(path).map_err(|e| NinferError::io(path, e))?;
    // SAFETY: the file is opened read-only; like every mmap-based loader we assume nobody
    // truncates the checkpoint while the model loads.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| NinferError::io(path, e))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|e| NinferError::malformed(path, format!("not a valid safetensors file (truncated?): {e}")))?;
    Ok(MappedFile { path: path.to_path_buf(), file, mmap, header_len, metadata })
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

impl WeightStore {
    /// Open the checkpoint of a model directory: `model.safetensors.index.json` when present,
    /// else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut files = Vec::new();
        let mut index = HashMap::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| NinferError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| NinferError::malformed(&index_path, e.to_string()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| NinferError::malformed(&index_path, "no `weight_map` object"))?;
            let mut shard_of: BTreeMap<String, usize> = BTreeMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| NinferError::malformed(&index_path, format!("weight_map[{name}] is not a file name")))?;
                let next = shard_of.len();
                let i = *shard_of.entry(file.to_string()).or_insert(next);
                index.insert(name.clone(), i);
            }
            let mut ordered: Vec<(usize, String)> = shard_of.into_iter().map(|(f, i)| (i, f)).collect();
            ordered.sort();
            for (_, f) in ordered {
                files.push(map_file(&dir.join(f))?);
            }
            for (name, &i) in &index {
                if files[i].metadata.info(name).is_none() {
                    return Err(NinferError::MissingTensor { name: name.clone(), path: files[i].path.clone() });
                }
            }
        } else if single.exists() {
            let f = map_file(&single)?;
            for name in f.metadata.tensors().keys() {
                index.insert(name.clone(), 0);
            }
            files.push(f);
        } else {
            return Err(NinferError::MissingFile { path: single, what: "the weights (model.safetensors or model.safetensors.index.json)".into() });
        }
        Ok(WeightStore { files, index, dir: dir.to_path_buf() })
    }

    /// True when the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.index.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Shape and dtype of a tensor, or a `MissingTensor` error naming the checkpoint.
    pub fn info(&self, name: &str) -> Result<TensorInfo> {
        let (f, info) = self.locate(name)?;
        let _ = f;
        Ok(TensorInfo { shape: info.shape.clone(), dtype: dtype_name(info.dtype) })
    }

    fn locate(&self, name: &str) -> Result<(&MappedFile, &::safetensors::tensor::TensorInfo)> {
        let missing = || NinferError::MissingTensor { name: name.to_string(), path: self.dir.clone() };
        let &i = self.index.get(name).ok_or_else(missing)?;
        let f = &self.files[i];
        let info = f.metadata.info(name).ok_or_else(missing)?;
        Ok((f, info))
    }

    /// The stored bytes of a tensor after checking its shape against `expected`, its dtype
    /// against those the loaders convert (F32, F16, BF16) and its byte range against the file:
    /// the one validation every loader goes through.
    pub fn raw(&self, name: &str, expected: &[usize]) -> Result<RawTensor<'_>> {
        let (f, info) = self.locate(name)?;
        if info.shape != expected {
            return Err(NinferError::TensorShape { name: name.to_string(), expected: expected.to_vec(), got: info.shape.clone() });
        }
        let elem = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => return Err(NinferError::TensorDtype { name: name.to_string(), dtype: dtype_name(other) }),
        };
        let start = 8 + f.header_len + info.data_offsets.0;
        let end = 8 + f.header_len + info.data_offsets.1;
        let bytes = f
            .mmap
            .get(start..end)
            .ok_or_else(|| NinferError::malformed(&f.path, format!("tensor {name} lies past the end of the file")))?;
        let numel: usize = info.shape.iter().product();
        if bytes.len() != numel * elem {
            return Err(NinferError::malformed(&f.path, format!("tensor {name} has {} values, shape needs {numel}", bytes.len() / elem)));
        }
        Ok(RawTensor { name: name.to_string(), dtype: info.dtype, numel, bytes, file: &f.file, path: &f.path, offset: start as u64 })
    }

    /// The stored bytes of a tensor of any dtype (a quantized weight or one of its scale / zero
    /// companions) with its shape and dtype, after checking its byte range against the file; the
    /// quantized formats' own validation checks the rest.
    pub fn stored(&self, name: &str) -> Result<(TensorInfo, &[u8])> {
        let (f, info) = self.locate(name)?;
        let start = 8 + f.header_len + info.data_offsets.0;
        let end = 8 + f.header_len + info.data_offsets.1;
        let bytes = f
            .mmap
            .get(start..end)
            .ok_or_else(|| NinferError::malformed(&f.path, format!("tensor {name} lies past the end of the file")))?;
        let numel: usize = info.shape.iter().product();
        if bytes.len() * 8 != numel * info.dtype.bitsize() {
            return Err(NinferError::malformed(&f.path, format!("tensor {name} holds {} bytes, its shape {:?} needs {}", bytes.len(), info.shape, numel * info.dtype.bitsize() / 8)));
        }
        Ok((TensorInfo { shape: info.shape.clone(), dtype: dtype_name(info.dtype) }, bytes))
    }

    /// Load a tensor as f32 after checking that its shape is `expected`.
    pub fn load_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let raw = self.raw(name, expected)?;
        let mut out = vec![0f32; raw.numel];
        raw.f32_into(0, &mut out);
        Ok(out)
    }
}

/// A validated tensor of a mapped checkpoint: its bytes in the mapping and where they lie in
/// the file.
pub struct RawTensor<'a> {
    /// Name in the checkpoint (for error messages).
    pub name: String,
    /// Stored dtype: F32, F16 or BF16 (`WeightStore::raw` refuses others).
    pub dtype: Dtype,
    /// Number of elements.
    pub numel: usize,
    /// The stored little-endian bytes, in the memory mapping.
    pub bytes: &'a [u8],
    file: &'a File,
    path: &'a Path,
    /// Byte offset of `bytes` in the file.
    offset: u64,
}

impl RawTensor<'_> {
    /// Elements `first..first + out.len()` as f32.
    pub fn f32_into(&self, first: usize, out: &mut [f32]) {
        let n = out.len();
        match self.dtype {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(self.bytes[4 * first..4 * (first + n)].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(self.bytes[2 * first..2 * (first + n)].chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            _ => {
                for (o, b) in out.iter_mut().zip(self.bytes[2 * first..2 * (first + n)].chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }

    /// Copies stored bytes `first..first + out.len()` into `out` with one positioned read of
    /// the file instead of through the mapping: a read copies from the page cache without a
    /// page fault per 4 KiB, which is what dominates copying a mapped 50 GB checkpoint.
    #[cfg(unix)]
    pub fn read_into(&self, first: usize, out: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        debug_assert!(first + out.len() <= self.bytes.len());
        self.file.read_exact_at(out, self.offset + first as u64).map_err(|e| NinferError::io(self.path, e))
    }

    /// Copies stored bytes `first..first + out.len()` into `out` (from the mapping where
    /// positioned reads are not available).
    #[cfg(not(unix))]
    pub fn read_into(&self, first: usize, out: &mut [u8]) -> Result<()> {
        let _ = (self.file, self.path, self.offset);
        out.copy_from_slice(&self.bytes[first..first + out.len()]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::safetensors::tensor::TensorView;

    fn write(dir: &Path, file: &str, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let bufs: Vec<Vec<u8>> = tensors.iter().map(|(_, _, d)| d.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bufs)
            .map(|((n, s, _), b)| (n.to_string(), TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        ::safetensors::tensor::serialize_to_file(views, None, &dir.join(file)).unwrap();
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ninfer_st_{tag}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn single_file_loads_and_checks_shape() {
        let d = tmpdir("single");
        write(&d, "model.safetensors", &[("a", vec![2, 3], (0..6).map(|x| x as f32).collect())]);
        let s = WeightStore::open(&d).unwrap();
        assert_eq!(s.load_f32("a", &[2, 3]).unwrap()[5], 5.0);
        assert!(matches!(s.load_f32("a", &[3, 2]), Err(NinferError::TensorShape { .. })));
        assert!(matches!(s.load_f32("b", &[1]), Err(NinferError::MissingTensor { .. })));
    }

    #[test]
    fn sharded_index_resolves_tensors_across_files() {
        let d = tmpdir("shards");
        write(&d, "s1.safetensors", &[("a", vec![2], vec![1.0, 2.0])]);
        write(&d, "s2.safetensors", &[("b", vec![1], vec![3.0])]);
        std::fs::write(d.join("model.safetensors.index.json"), r#"{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}"#).unwrap();
        let s = WeightStore::open(&d).unwrap();
        assert_eq!(s.load_f32("b", &[1]).unwrap(), vec![3.0]);
        assert_eq!(s.names(), vec!["a", "b"]);
    }

    #[test]
    fn truncated_file_is_malformed_and_names_the_path() {
        let d = tmpdir("trunc");
        write(&d, "model.safetensors", &[("a", vec![64], vec![1.0; 64])]);
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 10]).unwrap();
        match WeightStore::open(&d) {
            Err(NinferError::MalformedFile { path, .. }) => assert_eq!(path, p),
            other => panic!("expected MalformedFile, got {:?}", other.err()),
        }
    }
}
