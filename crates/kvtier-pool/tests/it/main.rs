//! The DRAM tier's and the SSD pool's integration tests, one test binary: each file is a module (`cargo test -p kvtier-pool
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.

mod common;
mod dram_capacity_and_pins;
mod dram_corruption_is_never_served;
mod ssd_bad_inputs;
mod ssd_capacity_and_enospc;
mod ssd_compaction_faults;
mod ssd_concurrency;
mod ssd_corruption_is_a_miss;
mod ssd_crash_recovery;
mod ssd_round_trip;
