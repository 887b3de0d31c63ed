//! The shape of a model's KV cache, and every size derived from it.
//!
//! A *segment* is the K (or the V) of one layer of one block: `block_tokens * num_kv_heads *
//! head_dim * dtype` bytes, the unit a paged pool stores contiguously. A *layer-block* is K and V
//! of one layer of one block. A *block* is all layers of one block plus the extra KV groups of a
//! hybrid model (sliding-window, Mamba state, MLA latent), each with its own bytes per token.

use crate::error::GeometryError;

/// Largest block kvtier accepts (1 GiB): objects are meant to be 0.25–4 MiB (DESIGN §7).
pub const BLOCK_BYTES_MAX: u64 = 1 << 30;

/// Element type of the KV cache. fp8 variants are carried as raw bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    Bf16,
    F32,
    Fp8E4m3,
    Fp8E5m2,
}

impl Dtype {
    pub const ALL: [Dtype; 5] = [Dtype::F16, Dtype::Bf16, Dtype::F32, Dtype::Fp8E4m3, Dtype::Fp8E5m2];

    pub fn size_bytes(self) -> u32 {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "fp16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "fp32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
        }
    }

    /// Stable one-byte code, part of the namespace fingerprint (never renumber).
    pub fn code(self) -> u8 {
        match self {
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
            Dtype::F32 => 3,
            Dtype::Fp8E4m3 => 4,
            Dtype::Fp8E5m2 => 5,
        }
    }

    /// Parses the canonical names and the usual aliases (`float16`, `bfloat16`, `float32`, `fp8`).
    pub fn parse(name: &str) -> Result<Self, GeometryError> {
        match name.to_ascii_lowercase().as_str() {
            "fp16" | "float16" | "half" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp32" | "float32" | "float" => Ok(Dtype::F32),
            "fp8" | "fp8_e4m3" | "float8_e4m3fn" => Ok(Dtype::Fp8E4m3),
            "fp8_e5m2" | "float8_e5m2" => Ok(Dtype::Fp8E5m2),
            _ => Err(GeometryError::UnknownDtype(name.to_string())),
        }
    }
}

/// An extra KV group of a hybrid model, stored after the main K/V in each block.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExtraGroup {
    pub name: String,
    pub bytes_per_token: u32,
}

/// Validated KV-cache geometry. Construct with [`Geometry::new`]; fields are read-only.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: Dtype,
    block_tokens: u32,
    extra_groups: Vec<ExtraGroup>,
}

fn check_range(field: &'static str, value: u64, lo: u64, hi: u64) -> Result<(), GeometryError> {
    if value < lo || value > hi {
        return Err(GeometryError::OutOfRange { field, value, expected: format!("{lo}..={hi}") });
    }
    Ok(())
}

impl Geometry {
    pub fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: Dtype,
        block_tokens: u32,
        extra_groups: Vec<ExtraGroup>,
    ) -> Result<Self, GeometryError> {
        check_range("num_layers", num_layers.into(), 1, 1024)?;
        check_range("num_kv_heads", num_kv_heads.into(), 1, 1024)?;
        check_range("head_dim", head_dim.into(), 1, 16384)?;
        check_range("block_tokens", block_tokens.into(), 1, 65536)?;
        for (index, group) in extra_groups.iter().enumerate() {
            if group.name.is_empty() {
                return Err(GeometryError::EmptyGroupName { index });
            }
            check_range("extra_groups.bytes_per_token", group.bytes_per_token.into(), 1, 1 << 24)?;
            if extra_groups[..index].iter().any(|g| g.name == group.name) {
                return Err(GeometryError::DuplicateGroupName(group.name.clone()));
            }
        }
        let geometry = Geometry { num_layers, num_kv_heads, head_dim, dtype, block_tokens, extra_groups };
        // Computed in u128 so a hostile combination cannot overflow before it is rejected.
        let kv = 2
            * u128::from(num_layers)
            * u128::from(geometry.segment_elems())
            * u128::from(dtype.size_bytes());
        let extra: u128 = geometry
            .extra_groups
            .iter()
            .map(|g| u128::from(g.bytes_per_token) * u128::from(block_tokens))
            .sum();
        let bytes = kv + extra;
        if bytes > u128::from(BLOCK_BYTES_MAX) {
            return Err(GeometryError::BlockTooLarge {
                bytes: u64::try_from(bytes).unwrap_or(u64::MAX),
                max: BLOCK_BYTES_MAX,
            });
        }
        Ok(geometry)
    }

    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    pub fn extra_groups(&self) -> &[ExtraGroup] {
        &self.extra_groups
    }

    fn segment_elems(&self) -> u64 {
        u64::from(self.block_tokens) * u64::from(self.num_kv_heads) * u64::from(self.head_dim)
    }

    /// Bytes of K (or V) of one layer of one block: the contiguous unit of a paged pool.
    pub fn segment_bytes(&self) -> u64 {
        self.segment_elems() * u64::from(self.dtype.size_bytes())
    }

    /// Bytes of K and V of one layer of one block.
    pub fn layer_block_bytes(&self) -> u64 {
        2 * self.segment_bytes()
    }

    /// Bytes of the main K/V of one block (all layers), without extra groups.
    pub fn kv_block_bytes(&self) -> u64 {
        u64::from(self.num_layers) * self.layer_block_bytes()
    }

    /// Bytes of extra group `index` in one block.
    pub fn extra_group_block_bytes(&self, index: usize) -> u64 {
        u64::from(self.extra_groups[index].bytes_per_token) * u64::from(self.block_tokens)
    }

    /// Bytes of one whole block: main K/V plus every extra group. Also the payload size of an object.
    pub fn block_bytes(&self) -> u64 {
        let extra: u64 = (0..self.extra_groups.len()).map(|i| self.extra_group_block_bytes(i)).sum();
        self.kv_block_bytes() + extra
    }

    /// Bytes of KV per token, all layers and groups.
    pub fn bytes_per_token(&self) -> u64 {
        self.block_bytes() / u64::from(self.block_tokens)
    }

    /// Canonical little-endian encoding, hashed into the namespace. Stable across versions.
    pub fn fingerprint_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + 16 * self.extra_groups.len());
        out.extend_from_slice(b"geom");
        for v in [self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.dtype.code());
        out.extend_from_slice(&(self.extra_groups.len() as u32).to_le_bytes());
        for g in &self.extra_groups {
            out.extend_from_slice(&(g.name.len() as u32).to_le_bytes());
            out.extend_from_slice(g.name.as_bytes());
            out.extend_from_slice(&g.bytes_per_token.to_le_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> Geometry {
        Geometry::new(32, 8, 128, Dtype::Bf16, 16, vec![]).unwrap()
    }

    #[test]
    fn llama_3_8b_sizes() {
        let g = llama8b();
        assert_eq!(g.segment_bytes(), 16 * 8 * 128 * 2);
        assert_eq!(g.block_bytes(), 2 << 20);
        assert_eq!(g.bytes_per_token(), 128 << 10);
    }

    #[test]
    fn extra_groups_add_their_bytes() {
        let extra = vec![ExtraGroup { name: "mamba".into(), bytes_per_token: 100 }];
        let g = Geometry::new(2, 1, 4, Dtype::F32, 8, extra).unwrap();
        assert_eq!(g.kv_block_bytes(), 2 * 2 * 8 * 4 * 4);
        assert_eq!(g.block_bytes(), g.kv_block_bytes() + 800);
    }

    #[test]
    fn rejects_zero_and_huge() {
        let err = Geometry::new(0, 8, 128, Dtype::Bf16, 16, vec![]).unwrap_err();
        assert!(err.to_string().contains("num_layers"), "{err}");
        let err = Geometry::new(1024, 1024, 16384, Dtype::F32, 65536, vec![]).unwrap_err();
        assert!(matches!(err, GeometryError::BlockTooLarge { .. }), "{err}");
    }

    #[test]
    fn rejects_bad_groups() {
        let dup = vec![
            ExtraGroup { name: "a".into(), bytes_per_token: 1 },
            ExtraGroup { name: "a".into(), bytes_per_token: 2 },
        ];
        assert!(matches!(
            Geometry::new(1, 1, 1, Dtype::F16, 1, dup),
            Err(GeometryError::DuplicateGroupName(_))
        ));
        let empty = vec![ExtraGroup { name: String::new(), bytes_per_token: 1 }];
        assert!(matches!(
            Geometry::new(1, 1, 1, Dtype::F16, 1, empty),
            Err(GeometryError::EmptyGroupName { index: 0 })
        ));
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::parse(d.name()).unwrap(), d);
        }
        assert!(Dtype::parse("int4").is_err());
    }

    #[test]
    fn fingerprint_differs_by_every_field() {
        let base = llama8b().fingerprint_bytes();
        let others = [
            Geometry::new(31, 8, 128, Dtype::Bf16, 16, vec![]),
            Geometry::new(32, 4, 128, Dtype::Bf16, 16, vec![]),
            Geometry::new(32, 8, 64, Dtype::Bf16, 16, vec![]),
            Geometry::new(32, 8, 128, Dtype::F16, 16, vec![]),
            Geometry::new(32, 8, 128, Dtype::Bf16, 32, vec![]),
        ];
        for g in others {
            assert_ne!(g.unwrap().fingerprint_bytes(), base);
        }
    }
}
