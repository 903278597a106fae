//! Element types and their wire data types.

use std::fmt;

/// The wire identifier of an element type.
///
/// Each [`Element`] has exactly one `DType`; the byte from [`DType::to_wire`] travels in message
/// and collective headers so that a receiver can refuse data of another type.
///
/// ```
/// use nexar_types::DType;
/// assert_eq!(DType::from_wire(DType::BF16.to_wire()), Ok(DType::BF16));
/// assert_eq!(DType::F64.size(), 8);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// `f32`
    F32 = 1,
    /// `f64`
    F64 = 2,
    /// `half::f16`
    F16 = 3,
    /// `half::bf16`
    BF16 = 4,
    /// `i8`
    I8 = 5,
    /// `i16`
    I16 = 6,
    /// `i32`
    I32 = 7,
    /// `i64`
    I64 = 8,
    /// `u8`
    U8 = 9,
    /// `u16`
    U16 = 10,
    /// `u32`
    U32 = 11,
    /// `u64`
    U64 = 12,
}

/// A wire byte that names no [`DType`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype code {0} on the wire")]
pub struct UnknownDType(pub u8);

impl DType {
    /// Every data type, in wire-code order.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The byte that represents this type on the wire.
    pub const fn to_wire(self) -> u8 {
        self as u8
    }

    /// Decodes a wire byte; unknown codes are an error, never a panic.
    pub const fn from_wire(code: u8) -> Result<DType, UnknownDType> {
        if code >= 1 && code <= 12 { Ok(DType::ALL[(code - 1) as usize]) } else { Err(UnknownDType(code)) }
    }

    /// `true` for the integer types (the ones bitwise reductions accept).
    pub const fn is_integer(self) -> bool {
        !matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The Rust name of the type, as a user writes it.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed: crate::op::Kernels {}
}

/// A plain-old-data type that nexar can move and reduce.
///
/// Implemented for `f32`, `f64`, [`half::f16`], [`half::bf16`], `i8`–`i64` and `u8`–`u64`. The
/// trait is sealed: the set of element types is the set of wire [`DType`]s.
///
/// ```
/// use nexar_types::{DType, Element};
/// fn dtype_of<T: Element>(_: &[T]) -> DType { T::DTYPE }
/// assert_eq!(dtype_of(&[1u16, 2]), DType::U16);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a nexar element type",
    label = "`{Self}` cannot travel in a nexar buffer",
    note = "nexar moves f32, f64, half::f16, half::bf16, i8, i16, i32, i64, u8, u16, u32 and u64",
    note = "to send structured data, flatten it into one of these types or use an RPC, whose arguments are serialised"
)]
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + sealed::Sealed + DeviceElement {
    /// The wire type of this element.
    const DTYPE: DType;
}

/// What device memory needs of an element type (nothing unless the `cuda` feature is on).
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Unpin {}
/// What device memory needs of an element type (nothing unless the `cuda` feature is on).
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
pub trait DeviceElement {}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl DeviceElement for $t {}
            impl Element for $t {
                const DTYPE: DType = DType::$d;
            }
        )*
    };
}

element! {
    f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16,
    i8 => I8, i16 => I16, i32 => I32, i64 => I64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_codes_round_trip_and_sizes_match_rust() {
        for d in DType::ALL {
            assert_eq!(DType::from_wire(d.to_wire()), Ok(d));
        }
        assert_eq!(DType::from_wire(0), Err(UnknownDType(0)));
        assert_eq!(DType::from_wire(13), Err(UnknownDType(13)));
        assert_eq!(DType::from_wire(255), Err(UnknownDType(255)));
        assert_eq!(DType::F32.size(), size_of::<f32>());
        assert_eq!(DType::BF16.size(), size_of::<half::bf16>());
        assert_eq!(DType::U64.size(), size_of::<u64>());
        assert!(DType::I8.is_integer() && !DType::F16.is_integer());
    }
}
