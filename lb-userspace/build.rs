//! Embeds the kernel object built by `cargo xtask build-ebpf` so `lb` is one file.
//! A build without it still succeeds (clippy, unit tests); `lb agent` then explains
//! how to get the object instead of failing obscurely.

use std::{env, fs, path::PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=LB_EBPF_OBJECT");
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let object = env::var_os("LB_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            manifest_dir.join("../lb-ebpf/target/bpfel-unknown-none/release/lb-ebpf")
        });
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("lb-ebpf.o");
    let bytes = fs::read(&object).unwrap_or_default();
    fs::write(&out, bytes).expect("write embedded kernel object");
}
