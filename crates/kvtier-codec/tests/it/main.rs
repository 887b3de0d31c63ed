//! kvtier-codec's integration tests, one test binary: each file is a module (`cargo test -p kvtier-codec
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.

mod decode_into;
mod round_trip;
mod untrusted_bytes;
