//! `logdex`: the server (`serve`), a local development cluster (`dev`) and
//! client commands against any node.

use clap::Parser;

/// mimalloc instead of glibc malloc: tasks allocate on one worker thread and free on another,
/// which sends glibc into its slow paths (see ARCHITECTURE.md, "Allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let args = match logdex_api::cli::with_config_file(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("logdex: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cli = logdex_api::cli::Cli::parse_from(args);
    match logdex_api::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("logdex: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
