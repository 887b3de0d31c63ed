//! kvtier-remote: the `remote` tier — kvtier objects on a Redis/Valkey server or a Redis
//! Cluster, so that stores in different processes and on different nodes share one cache.
//!
//! - [`config`]: servers, cluster mode, TTL, timeouts, reconnect backoff, in-flight bound, key
//!   prefix; validated at start. [`url`]: parsing and redacting `redis://user:password@host:port/db`.
//! - [`resp`]: a minimal RESP2 connection that reads GET values straight into caller buffers;
//!   `dial`: its TCP connection, host name lookup included, within the connect timeout.
//! - [`pipeline`]: sliding-window pipelines of EXISTS/GET/SET/DEL on one connection.
//! - [`cluster`]: hash slots and the `CLUSTER SLOTS` map.
//! - [`client`]: [`RemoteClient`], batches split by node, run in parallel, faults as results.
//! - [`clear`]: deleting every key of a pattern (SCAN + UNLINK on every master), and the
//!   pattern of one namespace's objects ([`RemoteTier::clear_namespace`]).
//! - [`tier`]: [`RemoteTier`], the [`kvtier_core::tier::Tier`] the store stacks below DRAM and SSD.
//! - [`metrics`]: per-operation latency/bytes/errors, reconnects, down misses, bad values.
//! - [`tls`]: `rediss://` with rustls (feature `tls`, default).
//!
//! Invariants: no bytes count as loaded unless header, namespace, key, length and payload
//! checksum verify; nothing received is ever deserialised beyond the fixed 64-byte header; a
//! down or misbehaving server yields counted misses, never a panic or an error while serving;
//! every buffer and window is bounded (`inflight_bytes_max`, connections per node, reply sizes).

pub mod clear;
pub mod client;
pub mod cluster;
pub mod config;
mod dial;
pub mod error;
pub mod metrics;
mod node;
pub mod pipeline;
pub mod resp;
#[cfg(feature = "test-hooks")]
pub mod testing;
pub mod tier;
pub mod tls;
pub mod url;

pub use clear::{glob_escape, is_namespace_key, namespace_pattern};
pub use client::RemoteClient;
pub use config::{RemoteConfig, TlsConfig};
pub use error::RemoteError;
pub use metrics::{OpMetrics, RemoteMetrics};
pub use tier::{key_name, RemoteTier};
