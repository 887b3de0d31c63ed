//! The remote tier's integration tests, one test binary: each file is a module (`cargo test -p kvtier-remote
//! --test it <file>::` runs one file's tests). One binary links once, where a binary per file
//! linked and compiled the dependencies' generic code once per file.

mod clear_removes_one_namespace;
mod faults_are_misses;
mod garbage_replies_never_panic;
mod resharding_is_followed;
mod slow_servers_are_bounded;
