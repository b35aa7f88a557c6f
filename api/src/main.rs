//! `logdex`: the server (`serve`), a local development cluster (`dev`) and
//! client commands against any node.

mod cli;
mod dev;
mod error;
mod http;
mod murmur2;
mod routing;
mod serve;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    match cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("logdex: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
