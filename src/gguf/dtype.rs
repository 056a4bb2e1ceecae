//! The ggml tensor type table: ids, names, block sizes and byte sizes.
//!
//! Kept complete (ids and sizes as gguf-py 0.19 knows them) even for types we cannot dequantize (Q8_1,
//! Q8_K, I8..I64, Q1_0), so that any real file can be parsed, inspected and sized; only a tensor that is
//! actually needed errors out on its type.

/// One ggml type. `block` elements are stored in `type_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub block: usize,
    pub type_size: usize,
}

macro_rules! types {
    ($($id:literal $name:literal $block:literal $size:literal;)*) => {
        const TABLE: &[GgmlType] = &[$(GgmlType { id: $id, name: $name, block: $block, type_size: $size }),*];
    };
}

// Sizes from ggml's block structs (ggml-common.h); ids from ggml.h `enum ggml_type`.
types! {
    0 "F32" 1 4; 1 "F16" 1 2; 2 "Q4_0" 32 18; 3 "Q4_1" 32 20; 6 "Q5_0" 32 22; 7 "Q5_1" 32 24;
    8 "Q8_0" 32 34; 9 "Q8_1" 32 36; 10 "Q2_K" 256 84; 11 "Q3_K" 256 110; 12 "Q4_K" 256 144;
    13 "Q5_K" 256 176; 14 "Q6_K" 256 210; 15 "Q8_K" 256 292; 16 "IQ2_XXS" 256 66; 17 "IQ2_XS" 256 74;
    18 "IQ3_XXS" 256 98; 19 "IQ1_S" 256 50; 20 "IQ4_NL" 32 18; 21 "IQ3_S" 256 110; 22 "IQ2_S" 256 82;
    23 "IQ4_XS" 256 136; 24 "I8" 1 1; 25 "I16" 1 2; 26 "I32" 1 4; 27 "I64" 1 8; 28 "F64" 1 8;
    29 "IQ1_M" 256 56; 30 "BF16" 1 2; 34 "TQ1_0" 256 54; 35 "TQ2_0" 256 66; 39 "MXFP4" 32 17;
    40 "NVFP4" 64 36; 41 "Q1_0" 128 18;
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().copied().find(|t| t.id == id)
    }
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE
            .iter()
            .copied()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }
    pub fn all() -> &'static [GgmlType] {
        TABLE
    }
    /// candle's dtype for this type, when candle can read and dequantize it.
    pub fn candle(&self) -> Option<candle_core::quantized::GgmlDType> {
        use candle_core::quantized::GgmlDType as D;
        Some(match self.id {
            0 => D::F32,
            1 => D::F16,
            30 => D::BF16,
            2 => D::Q4_0,
            3 => D::Q4_1,
            6 => D::Q5_0,
            7 => D::Q5_1,
            8 => D::Q8_0,
            10 => D::Q2K,
            11 => D::Q3K,
            12 => D::Q4K,
            13 => D::Q5K,
            14 => D::Q6K,
            _ => return None,
        })
    }
    /// fuel-quantized's dtype for the block types candle lacks (the low-bit IQ*, TQ*, MXFP4, NVFP4).
    pub fn fuel(&self) -> Option<fuel_quantized::GgmlDType> {
        use fuel_quantized::GgmlDType as D;
        Some(match self.id {
            16 => D::Iq2Xxs,
            17 => D::Iq2Xs,
            18 => D::Iq3Xxs,
            19 => D::Iq1S,
            20 => D::Iq4Nl,
            21 => D::Iq3S,
            22 => D::Iq2S,
            23 => D::Iq4Xs,
            29 => D::Iq1M,
            34 => D::Tq1_0,
            35 => D::Tq2_0,
            39 => D::Mxfp4,
            40 => D::Nvfp4,
            _ => return None,
        })
    }
    /// Whether values of this type can be turned into numbers here: candle's and fuel's types, plain F64.
    pub fn dequantizable(&self) -> bool {
        self.candle().is_some() || self.fuel().is_some() || self.id == 28
    }
    /// Bytes of a row-major tensor of `n` elements, `None` if `n` is not a whole number of blocks.
    pub fn bytes_for(&self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block as u64) {
            return None;
        }
        (n / self.block as u64).checked_mul(self.type_size as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}
