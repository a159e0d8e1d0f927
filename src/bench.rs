//! `reprise bench`: measurements side by side in one run, reported as ratios.

use clap::Args;

/// Arguments of `reprise bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {}

/// Runs the selected benchmark.
pub async fn run(_args: BenchArgs) -> anyhow::Result<()> {
    Ok(())
}
