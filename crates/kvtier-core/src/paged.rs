//! An engine's paged KV pool as *regions*, so the store can copy straight between its own
//! objects and the engine's blocks (one copy each way, no staging object in between).
//!
//! A region is one piece of every block: region `r` holds `block_len(r)` bytes of block `b` at
//! `base(r) + b * block_len(r)`, and those bytes are bytes `object_off(r)..object_off(r) +
//! block_len(r)` of block `b`'s object. Regions are listed in object order and tile the object
//! exactly. They are grouped into *layers*, the unit of layerwise progress (attention on layer
//! `l` may start once every region of layer `l` is in place).
//!
//! Both pool shapes kvtier meets are region lists:
//! - kvtier's own `LayerFirst` pool ([`crate::layout`]): regions K and V of each layer, one slice
//!   of one buffer each, then the extra groups (in a last "layer" of their own);
//! - vLLM's per-layer tensors: on CPU one region per layer (K and V interleaved per token), on
//!   CUDA two (K, then V), each its own tensor.
//!
//! A `PagedPool` holds raw pointers: building one is `unsafe`, and its user must keep the
//! buffers alive and not accessed by anyone else while a copy runs.

use std::ops::Range;

use crate::error::LayoutError;
use crate::geometry::Geometry;

/// One region: `block_len` bytes per block at `base + block * block_len`.
#[derive(Clone, Copy, Debug)]
struct Region {
    base: *mut u8,
    block_len: usize,
    object_off: usize,
}

/// An engine pool as regions grouped into layers (see the module docs).
#[derive(Debug)]
pub struct PagedPool {
    regions: Vec<Region>,
    layers: Vec<Range<usize>>,
    num_blocks: usize,
    block_bytes: usize,
}

// SAFETY: the pointers are only dereferenced by copies whose callers promised (when building
// the pool) exclusive access to the buffers for the pool's use; the copy workers write disjoint
// block pieces (distinct block ids are checked before any copy).
unsafe impl Send for PagedPool {}
unsafe impl Sync for PagedPool {}

impl PagedPool {
    /// A pool of `num_blocks` blocks from `regions` (`(base, block_len)` each, in object order;
    /// `layer_regions[l]` of them make layer `l`).
    ///
    /// Errors: [`LayoutError::EmptyPool`] (no blocks), [`LayoutError::Regions`] (no region, a
    /// region of 0 bytes per block, or layer counts that do not add up to the regions).
    ///
    /// # Safety
    /// Each `base` is valid for reads and writes of `num_blocks * block_len` bytes for as long
    /// as the pool is used, the regions do not overlap, and nobody else accesses them while a
    /// copy through the pool runs.
    pub unsafe fn from_regions(
        regions: &[(*mut u8, usize)],
        layer_regions: &[usize],
        num_blocks: usize,
    ) -> Result<Self, LayoutError> {
        if num_blocks == 0 {
            return Err(LayoutError::EmptyPool);
        }
        if regions.is_empty() {
            return Err(LayoutError::Regions("a paged pool needs at least one region".into()));
        }
        if let Some(r) = regions.iter().position(|&(_, len)| len == 0) {
            return Err(LayoutError::Regions(format!("region {r} holds 0 bytes per block")));
        }
        // Checked: counts from a caller (Python) that wrap around to the number of regions would
        // make a layer's range run past the regions.
        let total = layer_regions.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
        if total != Some(regions.len()) || layer_regions.contains(&0) {
            return Err(LayoutError::Regions(format!(
                "layers hold {layer_regions:?} regions; expected positive counts adding up to the {} regions",
                regions.len()
            )));
        }
        let mut object_off = 0usize;
        let regions: Vec<Region> = regions
            .iter()
            .map(|&(base, block_len)| {
                let r = Region { base, block_len, object_off };
                object_off += block_len;
                r
            })
            .collect();
        let mut layers = Vec::with_capacity(layer_regions.len());
        let mut start = 0;
        for &n in layer_regions {
            layers.push(start..start + n);
            start += n;
        }
        Ok(PagedPool { regions, layers, num_blocks, block_bytes: object_off })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Bytes of one block's object (the regions' `block_len`s added up).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The first region's base address: what names the pool's memory (kvtier-transfer keys the
    /// blocks of jobs in flight by it).
    pub fn base_address(&self) -> usize {
        self.regions[0].base as usize
    }

    /// The memory the pool covers: each region's `(start address, bytes)`.
    pub fn spans(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.regions.iter().map(|r| (r.base as usize, r.block_len.saturating_mul(self.num_blocks)))
    }

    /// Pieces of layer `layer` of a block: `(object_off, len)` of each of its regions, with the
    /// region's index.
    pub fn layer_pieces(&self, layer: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.layers[layer].clone().map(|r| (r, self.regions[r].object_off, self.regions[r].block_len))
    }

    /// Checks the pool's layers are `geometry`'s: as many, and layer `l` ends in a block's object
    /// where the geometry's layer `l` ends (the last one at the object's end, extra groups
    /// included, as `layer_first` groups them). A layerwise waiter counts the geometry's layers:
    /// a pool grouped otherwise (K and V as layers of their own, say) would announce a layer
    /// before its bytes landed.
    pub fn check_layers(&self, geometry: &Geometry) -> Result<(), LayoutError> {
        let (layers, seg) = (geometry.num_layers() as usize, geometry.segment_bytes() as usize);
        let want =
            |l: usize| if l + 1 == layers { geometry.block_bytes() as usize } else { 2 * (l + 1) * seg };
        let end = |l: usize| {
            let last = &self.regions[self.layers[l].end - 1];
            last.object_off + last.block_len
        };
        let problem = match (0..self.layers.len().min(layers)).find(|&l| end(l) != want(l)) {
            Some(l) => {
                format!("pool layer {l} ends at byte {} of a block, the geometry's at {}", end(l), want(l))
            }
            None if self.layers.len() != layers => format!("the pool has {} layers", self.layers.len()),
            None => return Ok(()),
        };
        Err(LayoutError::Regions(format!(
            "{problem}; a layerwise load needs the geometry's {layers} layers (as layer_first groups them)"
        )))
    }

    /// Where block `block`'s piece of region `region` lives.
    ///
    /// # Safety
    /// `block < num_blocks` and `region` in range (the pointer is then inside the region).
    #[inline]
    pub unsafe fn piece(&self, region: usize, block: usize) -> *mut u8 {
        let r = &self.regions[region];
        // SAFETY: in bounds of the region per the caller's contract and `from_regions`'.
        unsafe { r.base.add(block * r.block_len) }
    }

    /// Checks a block table against the pool: every id in range and no id twice (copies into
    /// the pool run on several threads, so destinations must be distinct). Returns the ids as
    /// `usize`.
    pub fn check_block_ids(&self, block_ids: &[u64]) -> Result<Vec<usize>, LayoutError> {
        let mut seen = vec![false; self.num_blocks];
        block_ids
            .iter()
            .enumerate()
            .map(|(index, &id)| {
                let b = usize::try_from(id).ok().filter(|&b| b < self.num_blocks).ok_or(
                    LayoutError::BlockOutOfRange { index, block_id: id, num_blocks: self.num_blocks as u64 },
                )?;
                if std::mem::replace(&mut seen[b], true) {
                    return Err(LayoutError::DuplicateBlock { block_id: id });
                }
                Ok(b)
            })
            .collect()
    }

    /// Copies layer `layer` of `object` (a whole block's object) into pool block `block`.
    /// Does not fence ([`crate::copy::fence`]).
    ///
    /// # Safety
    /// `block < num_blocks`, `object` holds `block_bytes` bytes, and nobody else accesses the
    /// block's pieces meanwhile.
    pub unsafe fn scatter_layer(&self, object: &[u8], block: usize, layer: usize) {
        for (r, off, len) in self.layer_pieces(layer) {
            // SAFETY: per the caller's contract; `object` and the pool never overlap (the
            // object is a shared borrow, the pool is exclusively the caller's).
            unsafe { crate::copy::copy_unfenced(self.piece(r, block), object[off..off + len].as_ptr(), len) };
        }
    }
}

impl PagedPool {
    /// Copies pool block `block` into `object` (`block_bytes`). Does not fence.
    ///
    /// # Safety
    /// `block < num_blocks`, and nobody writes the block's pieces meanwhile.
    pub unsafe fn gather_block(&self, block: usize, object: &mut [u8]) {
        assert_eq!(object.len(), self.block_bytes, "gather into one whole object");
        for r in 0..self.regions.len() {
            let Region { object_off, block_len, .. } = self.regions[r];
            // SAFETY: per the caller's contract; the object is exclusively borrowed.
            unsafe {
                crate::copy::copy_unfenced(object[object_off..].as_mut_ptr(), self.piece(r, block), block_len)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_tile_the_object_and_scatter_places_each_piece() {
        let n = 3;
        let mut a = vec![0u8; n * 4];
        let mut b = vec![0u8; n * 2];
        let mut c = vec![0u8; n * 5];
        let regions = [(a.as_mut_ptr(), 4), (b.as_mut_ptr(), 2), (c.as_mut_ptr(), 5)];
        // SAFETY: the vectors outlive the pool and are not touched while it copies.
        let pool = unsafe { PagedPool::from_regions(&regions, &[2, 1], n) }.unwrap();
        assert_eq!((pool.block_bytes(), pool.num_layers()), (11, 2));
        let object: Vec<u8> = (1..=11).collect();
        for layer in 0..2 {
            // SAFETY: block 1 < 3; the object is 11 bytes.
            unsafe { pool.scatter_layer(&object, 1, layer) };
        }
        assert_eq!(a, [0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        assert_eq!(b, [0, 0, 5, 6, 0, 0]);
        assert_eq!(c, [0, 0, 0, 0, 0, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0]);
        let mut back = vec![0u8; 11];
        // SAFETY: block 1 < 3; nobody writes the pool meanwhile.
        unsafe { pool.gather_block(1, &mut back) };
        assert_eq!(back, object);
    }

    #[test]
    fn a_layerwise_load_needs_the_geometrys_layers() {
        let g = Geometry::new(2, 1, 4, crate::geometry::Dtype::F16, 2, vec![]).unwrap(); // 16-byte segments
        let mut a = [0u8; 4 * 16];
        let r: Vec<(*mut u8, usize)> = (0..4).map(|i| (a[i * 16..].as_mut_ptr(), 16)).collect();
        let check = |layers: &[usize]| {
            // SAFETY: `a` outlives the pool, which copies nothing here.
            unsafe { PagedPool::from_regions(&r, layers, 1) }.unwrap().check_layers(&g)
        };
        assert_eq!(check(&[2, 2]), Ok(()));
        for (layers, found) in
            [(&[1, 1, 1, 1][..], "pool layer 0 ends at byte 16"), (&[3, 1], "layer 0 ends at byte 48")]
        {
            let err = check(layers).unwrap_err().to_string();
            assert!(err.contains(found), "{err}");
        }
        assert!(check(&[4]).unwrap_err().to_string().contains("pool layer 0 ends at byte 64"));
    }

    #[test]
    fn bad_shapes_and_tables_are_named() {
        let mut a = vec![0u8; 8];
        let r = [(a.as_mut_ptr(), 4)];
        // SAFETY (each call): `a` outlives the pools and is not accessed meanwhile.
        unsafe {
            assert_eq!(PagedPool::from_regions(&r, &[1], 0).unwrap_err(), LayoutError::EmptyPool);
            assert!(matches!(PagedPool::from_regions(&[], &[], 2), Err(LayoutError::Regions(_))));
            assert!(matches!(PagedPool::from_regions(&r, &[2], 2), Err(LayoutError::Regions(_))));
            assert!(matches!(PagedPool::from_regions(&r, &[1, 0], 2), Err(LayoutError::Regions(_))));
            assert!(matches!(PagedPool::from_regions(&r, &[usize::MAX, 2], 2), Err(LayoutError::Regions(_))));
            assert!(matches!(
                PagedPool::from_regions(&[(a.as_mut_ptr(), 0)], &[1], 2),
                Err(LayoutError::Regions(_))
            ));
        }
        // SAFETY: as above.
        let pool = unsafe { PagedPool::from_regions(&r, &[1], 2) }.unwrap();
        assert_eq!(pool.check_block_ids(&[1, 0]).unwrap(), vec![1, 0]);
        assert_eq!(
            pool.check_block_ids(&[0, 2]).unwrap_err(),
            LayoutError::BlockOutOfRange { index: 1, block_id: 2, num_blocks: 2 }
        );
        assert_eq!(pool.check_block_ids(&[1, 1]).unwrap_err(), LayoutError::DuplicateBlock { block_id: 1 });
    }
}
