//! Empty: the crate has a build script only so that its `[build-dependencies]` feature pins
//! (Cargo.toml) apply to the host-side crates, as in the project's own build.

fn main() {}
