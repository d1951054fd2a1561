//! Tensors in from Python by DLPack: a `dltensor` capsule (`torch.utils.dlpack.to_dlpack(t)`,
//! the cheap way: ~0.5 µs) or any object with `__dlpack__` (torch tensors, numpy arrays).
//!
//! The capsule is consumed (renamed `used_dltensor`, as the protocol says), so a [`Tensor`]
//! owns its producer's reference to the memory and frees it with the producer's deleter when
//! dropped: a binding's object that keeps a tensor (a weight, a norm) keeps the memory alive
//! by holding it. Every view checks the dtype, the device (CPU), the layout and the alignment
//! from the tensor's own description; an empty tensor gives an empty slice, never a slice
//! made from its (possibly null) address.

use std::borrow::Cow;
use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

use fastsched_kernels::attention::{Floats, FloatsMut};
use fastsched_kernels::checks::{self, Span};
use fastsched_kernels::elementwise::NormWeight;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

// The DLPack 0.8 ABI (dlpack.h), as torch.utils.dlpack.to_dlpack and numpy give it.
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const KDL_CPU: i32 = 1;
const KDL_CPU_PINNED: i32 = 3;
const CAPSULE: &CStr = c"dltensor";
const USED_CAPSULE: &CStr = c"used_dltensor";

/// The element types the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    Bf16,
    I8,
    U8,
    I32,
    I64,
    Other { code: u8, bits: u8 },
}

impl DType {
    fn of(t: DLDataType) -> DType {
        match (t.code, t.bits) {
            (2, 32) => DType::F32,
            (4, 16) => DType::Bf16,
            (0, 8) => DType::I8,
            (1, 8) => DType::U8,
            (0, 32) => DType::I32,
            (0, 64) => DType::I64,
            (code, bits) => DType::Other { code, bits },
        }
    }

    pub(crate) fn name(self) -> String {
        match self {
            DType::F32 => "float32".into(),
            DType::Bf16 => "bfloat16".into(),
            DType::I8 => "int8".into(),
            DType::U8 => "uint8".into(),
            DType::I32 => "int32".into(),
            DType::I64 => "int64".into(),
            DType::Other { code, bits } => format!("DLPack type (code {code}, {bits} bits)"),
        }
    }
}

/// A Rust element type and the DLPack dtype whose memory it reads.
pub(crate) trait Elem: Copy {
    const DTYPE: DType;
}

macro_rules! elem {
    ($($t:ty => $d:ident),*) => { $(impl Elem for $t { const DTYPE: DType = DType::$d; })* };
}
elem!(f32 => F32, u16 => Bf16, i8 => I8, u8 => U8, i32 => I32, i64 => I64);

/// A CPU tensor taken from Python, named for the errors.
pub(crate) struct Tensor {
    name: Cow<'static, str>,
    managed: NonNull<DLManagedTensor>,
}

// SAFETY: the tensor is only read through `&self` (views alias nothing written: the callers
// run `check_no_aliasing`), and the deleter is called once, from `Drop`; DLPack's deleters
// may run on any thread (numpy's takes the GIL itself).
unsafe impl Send for Tensor {}
unsafe impl Sync for Tensor {}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: the capsule was consumed by `take`, so this is the one owner.
        unsafe {
            if let Some(deleter) = self.managed.as_ref().deleter {
                deleter(self.managed.as_ptr());
            }
        }
    }
}

impl Tensor {
    /// Takes `obj` (a `dltensor` capsule, or an object with `__dlpack__`) as the tensor
    /// `name`: TypeError if it is neither, ValueError if it is not on the CPU.
    pub(crate) fn take(
        name: impl Into<Cow<'static, str>>,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<Tensor> {
        let name = name.into();
        let capsule = match obj.cast::<PyCapsule>() {
            Ok(c) => c.clone(),
            Err(_) => obj
                .call_method0("__dlpack__")
                .and_then(|c| Ok(c.cast_into::<PyCapsule>()?))
                .map_err(|e| {
                    PyTypeError::new_err(format!(
                        "{name} must be a DLPack capsule (torch.utils.dlpack.to_dlpack) or \
                         support __dlpack__; got {}: {e}",
                        obj.get_type().name().map_or("?".into(), |n| n.to_string())
                    ))
                })?,
        };
        let ptr = capsule.pointer_checked(Some(CAPSULE)).map_err(|_| {
            PyValueError::new_err(format!(
                "{name} is a used or foreign capsule, not a fresh dltensor"
            ))
        })?;
        // SAFETY: a valid name makes it a live DLManagedTensor; renaming it hands it to us.
        unsafe {
            if pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), USED_CAPSULE.as_ptr()) != 0 {
                return Err(PyErr::fetch(obj.py()));
            }
        }
        let t = Tensor {
            name,
            managed: ptr.cast(),
        };
        let dl = t.dl();
        if !matches!(dl.device.device_type, KDL_CPU | KDL_CPU_PINNED) {
            return Err(PyValueError::new_err(format!(
                "{} must be on the CPU; got DLPack device type {} (id {})",
                t.name, dl.device.device_type, dl.device.device_id
            )));
        }
        if dl.dtype.lanes != 1 || dl.ndim < 0 || (dl.ndim > 0 && dl.shape.is_null()) {
            return Err(PyValueError::new_err(format!(
                "{} has {} lanes and {} dims: not a plain tensor",
                t.name, dl.dtype.lanes, dl.ndim
            )));
        }
        if let Some(&d) = t.shape().iter().find(|&&d| d < 0) {
            return Err(PyValueError::new_err(format!(
                "{} has a dimension of {d}",
                t.name
            )));
        }
        Ok(t)
    }

    /// Takes `obj` if it is not None.
    pub(crate) fn take_opt(
        name: impl Into<Cow<'static, str>>,
        obj: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Tensor>> {
        obj.filter(|o| !o.is_none())
            .map(|o| Tensor::take(name, o))
            .transpose()
    }

    fn dl(&self) -> &DLTensor {
        // SAFETY: owned and alive until `Drop`.
        unsafe { &self.managed.as_ref().dl_tensor }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn dtype(&self) -> DType {
        DType::of(self.dl().dtype)
    }

    pub(crate) fn shape(&self) -> &[i64] {
        let dl = self.dl();
        if dl.ndim == 0 {
            return &[];
        }
        // SAFETY: DLPack gives `ndim` dims (checked non-null in `take`).
        unsafe { std::slice::from_raw_parts(dl.shape, dl.ndim as usize) }
    }

    /// Dimension `i`, 0 past the last one.
    pub(crate) fn dim(&self, i: usize) -> usize {
        self.shape().get(i).map_or(0, |&d| d as usize)
    }

    /// Fails unless the tensor has `ndim` dims.
    pub(crate) fn expect_ndim(&self, ndim: usize) -> PyResult<&Self> {
        if self.shape().len() != ndim {
            return Err(PyValueError::new_err(format!(
                "{} must have {ndim} dims; got shape {:?}",
                self.name,
                self.shape()
            )));
        }
        Ok(self)
    }

    fn strides(&self) -> Option<&[i64]> {
        let dl = self.dl();
        // SAFETY: as `shape`; null strides mean a compact row-major tensor.
        (!dl.strides.is_null() && dl.ndim > 0)
            .then(|| unsafe { std::slice::from_raw_parts(dl.strides, dl.ndim as usize) })
    }

    /// The elements from one row (dim 0) to the next and the elements the view spans, after
    /// checking that every dim but the first (all if `!strided_rows`) is compact.
    fn geometry(&self, strided_rows: bool) -> PyResult<(usize, usize)> {
        let shape = self.shape();
        if shape.contains(&0) {
            return Ok((0, 0)); // no elements: nothing is read, whatever the strides say
        }
        let mut inner = 1usize;
        for &d in shape.iter().skip(1) {
            inner = inner.checked_mul(d as usize).ok_or_else(|| {
                PyValueError::new_err(format!("{} {shape:?} has too many elements", self.name))
            })?;
        }
        let rows = shape.first().map_or(1, |&d| d as usize);
        let mut stride = inner;
        if let Some(strides) = self.strides() {
            let mut want = 1i64;
            for (i, (&d, &s)) in shape.iter().zip(strides).enumerate().rev() {
                if i == 0 && strided_rows && d > 1 {
                    if s < inner as i64 {
                        return Err(PyValueError::new_err(format!(
                            "{}'s rows are {s} elements apart, closer than a row ({inner})",
                            self.name
                        )));
                    }
                    stride = s as usize;
                } else if d > 1 && s != want {
                    return Err(PyValueError::new_err(format!(
                        "{} must be {}contiguous; got shape {shape:?}, strides {strides:?}",
                        self.name,
                        if strided_rows { "row-wise " } else { "" }
                    )));
                }
                want *= d;
            }
        }
        let span = (rows - 1)
            .checked_mul(stride)
            .and_then(|s| s.checked_add(inner))
            .ok_or_else(|| {
                PyValueError::new_err(format!("{}'s rows span too much memory", self.name))
            })?;
        Ok((stride, span))
    }

    fn start(&self) -> *mut u8 {
        let dl = self.dl();
        (dl.data as *mut u8).wrapping_add(dl.byte_offset as usize)
    }

    /// The first element's address, with [`Self::geometry`], for dtype `T` (checked, and
    /// the address's alignment).
    fn layout<T: Elem>(&self, strided_rows: bool) -> PyResult<(*mut T, usize, usize)> {
        let dtype = self.dtype();
        if dtype != T::DTYPE {
            return Err(PyTypeError::new_err(format!(
                "{} must be {}; got {}",
                self.name,
                T::DTYPE.name(),
                dtype.name()
            )));
        }
        let (stride, span) = self.geometry(strided_rows)?;
        let ptr = self.start() as *mut T;
        if span > 0 && (ptr.is_null() || (ptr as usize) % align_of::<T>() != 0) {
            return Err(PyValueError::new_err(format!(
                "{}'s data at {ptr:p} is not aligned to {} bytes",
                self.name,
                align_of::<T>()
            )));
        }
        Ok((ptr, stride, span))
    }

    /// The compact tensor's elements.
    pub(crate) fn slice<T: Elem>(&self) -> PyResult<&[T]> {
        let (ptr, _, len) = self.layout::<T>(false)?;
        // SAFETY: a live, aligned, compact CPU buffer of `len` elements (`layout`).
        Ok(if len == 0 {
            &[]
        } else {
            unsafe { std::slice::from_raw_parts(ptr, len) }
        })
    }

    /// As [`Self::slice`], written by the kernel: the caller checks with [`check_no_aliasing`]
    /// that no other buffer of the call overlaps it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slice_mut<T: Elem>(&self) -> PyResult<&mut [T]> {
        let (ptr, _, len) = self.layout::<T>(false)?;
        // SAFETY: as `slice`; unaliased (the caller's check).
        Ok(if len == 0 {
            &mut []
        } else {
            unsafe { std::slice::from_raw_parts_mut(ptr, len) }
        })
    }

    /// The rows (dim 0) of a tensor whose rows are compact but may lie any distance apart
    /// (a view of some heads of a fused q/k/v row): the span from the first row's start to
    /// the last one's end, and the elements from one row to the next.
    pub(crate) fn rows<T: Elem>(&self) -> PyResult<(&[T], usize)> {
        let (ptr, stride, len) = self.layout::<T>(true)?;
        // SAFETY: as `slice`: one buffer from the first row to the end of the last one.
        Ok((
            if len == 0 {
                &[]
            } else {
                unsafe { std::slice::from_raw_parts(ptr, len) }
            },
            stride,
        ))
    }

    /// As [`Self::rows`], written (as [`Self::slice_mut`]). The kernels write only the rows'
    /// own elements, not what lies between them.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn rows_mut<T: Elem>(&self) -> PyResult<(&mut [T], usize)> {
        let (ptr, stride, len) = self.layout::<T>(true)?;
        // SAFETY: as `slice_mut`.
        Ok((
            if len == 0 {
                &mut []
            } else {
                unsafe { std::slice::from_raw_parts_mut(ptr, len) }
            },
            stride,
        ))
    }

    fn float_error(&self) -> PyErr {
        PyTypeError::new_err(format!(
            "{} must be float32 or bfloat16; got {}",
            self.name,
            self.dtype().name()
        ))
    }

    /// The compact float32 or bfloat16 tensor.
    pub(crate) fn floats(&self) -> PyResult<Floats<'_>> {
        match self.dtype() {
            DType::F32 => Ok(Floats::F32(self.slice()?)),
            DType::Bf16 => Ok(Floats::Bf16(self.slice()?)),
            _ => Err(self.float_error()),
        }
    }

    pub(crate) fn floats_mut(&self) -> PyResult<FloatsMut<'_>> {
        match self.dtype() {
            DType::F32 => Ok(FloatsMut::F32(self.slice_mut()?)),
            DType::Bf16 => Ok(FloatsMut::Bf16(self.slice_mut()?)),
            _ => Err(self.float_error()),
        }
    }

    /// As [`Self::rows`] for a float32 or bfloat16 tensor.
    pub(crate) fn float_rows(&self) -> PyResult<(Floats<'_>, usize)> {
        match self.dtype() {
            DType::F32 => self.rows().map(|(s, st)| (Floats::F32(s), st)),
            DType::Bf16 => self.rows().map(|(s, st)| (Floats::Bf16(s), st)),
            _ => Err(self.float_error()),
        }
    }

    pub(crate) fn float_rows_mut(&self) -> PyResult<(FloatsMut<'_>, usize)> {
        match self.dtype() {
            DType::F32 => self.rows_mut().map(|(s, st)| (FloatsMut::F32(s), st)),
            DType::Bf16 => self.rows_mut().map(|(s, st)| (FloatsMut::Bf16(s), st)),
            _ => Err(self.float_error()),
        }
    }

    /// A norm weight: bfloat16 (Llama's rounding) or float32 (Gemma's `1 + w`).
    pub(crate) fn norm_weight(&self) -> PyResult<NormWeight<'_>> {
        match self.dtype() {
            DType::F32 => Ok(NormWeight::F32(self.slice()?)),
            DType::Bf16 => Ok(NormWeight::Bf16(self.slice()?)),
            _ => Err(self.float_error()),
        }
    }

    /// The bytes the tensor's view spans (rows apart if `strided_rows`), for
    /// [`check_no_aliasing`].
    pub(crate) fn span(&self, strided_rows: bool, written: bool) -> Span<'_> {
        let elems = self.geometry(strided_rows).map_or(0, |g| g.1);
        let start = self.start() as usize;
        Span {
            name: &self.name,
            start,
            end: start.saturating_add(elems * (self.dl().dtype.bits as usize).div_ceil(8)),
            written,
        }
    }
}

/// Fails (ValueError) naming two buffers of a call that overlap where one is written.
pub(crate) fn check_no_aliasing(spans: &[Span]) -> PyResult<()> {
    checks::check_no_aliasing(spans).map_err(PyValueError::new_err)
}
