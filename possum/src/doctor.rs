//! `possum doctor`: what this machine can do.

use anyhow::Result;

pub fn run() -> Result<bool> {
    let host = possum_criu::doctor::host_report();
    println!("{}", host.to_string().trim_end());
    match possum_cuda::probe() {
        Ok(info) => println!(
            "{:<20} {} device(s), driver CUDA {}.{}",
            "gpu",
            info.device_count,
            info.driver_version / 1000,
            info.driver_version % 1000 / 10
        ),
        Err(why) => println!("{:<20} none ({why})", "gpu"),
    }
    Ok(host.can_checkpoint())
}
