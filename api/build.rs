//! Generates the client gRPC API. `protoc` comes from the vendored binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Requests that do not decode are bad input (INVALID_ARGUMENT), not a server fault.
    tonic_prost_build::configure().codec_path("crate::grpc::RequestCodec").compile_with_config(
        config,
        &["proto/logdex.proto"],
        &["proto"],
    )?;
    println!("cargo:rerun-if-changed=proto/logdex.proto");
    Ok(())
}
