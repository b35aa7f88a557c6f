//! Generates the node-to-node protobuf types and the tonic service.
//! `protoc` comes from the vendored binary so a fresh machine needs no install.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        // Unimplemented methods answer UNIMPLEMENTED: lets unit tests serve one call.
        .generate_default_stubs(true)
        .type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")
        .compile_with_config(config, &["proto/raft.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/raft.proto");
    Ok(())
}
