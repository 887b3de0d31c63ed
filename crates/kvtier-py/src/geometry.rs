//! `Geometry` and namespaces for Python: validation and derived sizes come from kvtier-core.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::{Dtype, ExtraGroup, Geometry, Namespace};

use crate::errors::raise;

/// A validated geometry, held by the Python `kvtier.Geometry` dataclass.
#[pyclass(frozen, name = "CoreGeometry", module = "kvtier._core")]
pub struct CoreGeometry {
    pub inner: Geometry,
}

#[pymethods]
impl CoreGeometry {
    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, dtype, block_tokens, extra_groups))]
    fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: &str,
        block_tokens: u32,
        extra_groups: Vec<(String, u32)>,
    ) -> PyResult<Self> {
        let dtype = Dtype::parse(dtype).map_err(raise)?;
        let extra =
            extra_groups.into_iter().map(|(name, bytes_per_token)| ExtraGroup { name, bytes_per_token });
        let inner = Geometry::new(num_layers, num_kv_heads, head_dim, dtype, block_tokens, extra.collect())
            .map_err(raise)?;
        Ok(CoreGeometry { inner })
    }

    /// Derived sizes in bytes, and the canonical dtype name.
    fn sizes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = &self.inner;
        let d = PyDict::new(py);
        d.set_item("dtype", g.dtype().name())?;
        d.set_item("dtype_bytes", g.dtype().size_bytes())?;
        d.set_item("segment_bytes", g.segment_bytes())?;
        d.set_item("layer_block_bytes", g.layer_block_bytes())?;
        d.set_item("kv_block_bytes", g.kv_block_bytes())?;
        d.set_item("block_bytes", g.block_bytes())?;
        d.set_item("bytes_per_token", g.bytes_per_token())?;
        d.set_item("pool_bytes_per_block", kvtier_core::layout::pool_bytes(g, 1))?;
        Ok(d)
    }

    /// 16-byte little-endian namespace hash for this geometry and the given identity.
    fn namespace_hash(
        &self,
        model_id: String,
        layout_version: u32,
        cache_salt: String,
        rank: u32,
    ) -> PyResult<[u8; 16]> {
        let ns = Namespace { model_id, geometry: self.inner.clone(), layout_version, cache_salt, rank };
        Ok(ns.hash().map_err(raise)?.to_le_bytes())
    }
}
