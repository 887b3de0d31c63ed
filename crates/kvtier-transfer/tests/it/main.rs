//! The transfer engine's integration tests, one test binary: each file is a module (`cargo test -p kvtier-transfer
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.
//! `tests/no_allocation_on_hot_path.rs` stays a binary of its own: its counting global allocator
//! would count every other test's allocations.

mod common;
mod duplex_no_torn_or_stale_blocks;
mod failures_are_reported;
mod jobs_across_a_clear;
mod jobs_are_collected_once;
mod layerwise_wait;
mod paged_jobs;
mod pipelined_loads_are_correct;
mod racing_jobs_are_refused;
mod worker_panics_are_contained;
