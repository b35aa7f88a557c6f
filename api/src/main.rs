//! `logdex`: the server (`serve`), a local development cluster (`dev`) and
//! client commands against any node.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = logdex_api::cli::Cli::parse();
    match logdex_api::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("logdex: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
