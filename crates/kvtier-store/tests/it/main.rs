//! The store's integration tests, one test binary: each file is a module (`cargo test -p kvtier-store
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.

mod bad_inputs_are_errors;
mod capacity_never_exceeded;
mod clear_is_a_barrier;
mod codec_tiers;
mod common;
mod corruption_is_a_miss;
mod leases_pin_blocks;
mod namespace_separation;
mod no_torn_reads;
mod round_trip;
mod ssd_hierarchy;
mod tier_moves_race_safely;
