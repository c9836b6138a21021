//! Compiles Triton's `proto/model_config.proto` (the `ModelConfig` a
//! `config.pbtxt` holds) without protoc: protox parses it into a descriptor set,
//! prost-build generates the typed messages from it, and the descriptor set is
//! kept for prost-reflect, which reads the protobuf text format against it.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let proto = proto_dir.join("model_config.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile([&proto], [&proto_dir])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("model_config_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
