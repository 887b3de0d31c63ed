//! kvtier-core: the data model every other kvtier crate stands on. No I/O lives here.
//!
//! - [`geometry`]: the shape of a model's KV cache and the sizes derived from it.
//! - [`keys`]: namespaced, chained 128-bit block keys over token ids.
//! - [`object`]: the versioned, checksummed byte format of a stored block.
//! - [`layout`]: `LayerFirst` paged pools and `BlockFirst` objects, and the batched copies between them.
//! - [`copy`]: bulk copies at memory speed whatever the buffers' alignment (streaming stores).
//! - [`xxh3`]: the payload checksum's XXH3-64, streaming, with a loop that copies as it hashes.
//! - [`paged`]: an engine's paged pool as regions, for copies straight between store and engine.
//! - [`fields`]: report structs (counters, gauges, labels), declared once with their (name, value) list.
//! - [`parallel`]: the bounded worker pool that runs large copies.
//! - [`progress`]: the layers of a layerwise load in place, waited on by engine threads.
//!
//! Invariants: a block key never collides across namespaces by construction (the namespace hash
//! seeds the chain); every object read is verified against its xxh3 checksum before use.

pub mod checksum;
pub mod copy;
pub mod error;
pub mod fields;
pub mod geometry;
pub mod keys;
pub mod layout;
pub mod object;
pub mod paged;
pub mod parallel;
pub mod progress;
pub mod tier;
pub mod xxh3;

pub use error::{GeometryError, KeyError, LayoutError, ObjectError};
pub use fields::Fields;
pub use geometry::{Dtype, ExtraGroup, Geometry};
pub use keys::{block_keys, BlockKey, Namespace};
pub use object::{ObjectHeader, OBJECT_HEADER_BYTES};
