//! kvtier-core's integration tests, one test binary: each file is a module (`cargo test -p kvtier-core
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.

mod golden_keys;
mod layout_roundtrip;
