//! `logdex`: the server (`serve`), a local development cluster (`dev`) and
//! client commands against any node.

use clap::Parser;

/// mimalloc instead of glibc malloc: tasks allocate on one worker thread and free on another,
/// which sends glibc into its slow paths (see ARCHITECTURE.md, "Allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let args = logdex_api::cli::client_flags_after_command(std::env::args_os().collect());
    let (args, file) = match logdex_api::cli::with_config_file(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("logdex: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cli = match logdex_api::cli::Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let refused = e.use_stderr();
            let _ = e.print();
            if let Some(path) = file.filter(|_| refused) {
                eprintln!(
                    "note: flags not given on the command line or as LOGDEX_* variables came from the config file {path}"
                );
            }
            return std::process::ExitCode::from(if refused { 2 } else { 0 });
        }
    };
    match logdex_api::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("logdex: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
