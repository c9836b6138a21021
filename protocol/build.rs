//! Compiles `proto/inference.proto` (the KServe v2 / Triton gRPC protocol) without
//! protoc: protox parses it into a FileDescriptorSet in pure Rust, and
//! tonic-prost-build generates the messages, the server and the client from that.

//! Without the `grpc` feature there is nothing to generate.

#[cfg(feature = "grpc")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    use std::path::PathBuf;

    use prost::Message;

    let proto_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let proto = proto_dir.join("inference.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let descriptors = protox::compile([&proto], [&proto_dir])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // Kept for tests that compare kiln's protocol with Triton's on the wire.
    std::fs::write(
        out_dir.join("inference_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        // Tensor data as `bytes::Bytes`: decoded as slices of the received message.
        .bytes(".inference")
        .compile_fds(descriptors)?;
    Ok(())
}

#[cfg(not(feature = "grpc"))]
fn main() {}
