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
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    println!(
        "{:<20} {}",
        "huge pages",
        huge_pages(
            &read("/sys/kernel/mm/transparent_hugepage/enabled"),
            &read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            &read("/proc/mounts"),
        )
    );
    Ok(host.can_checkpoint())
}

/// The selected `[mode]` of a transparent-huge-page setting, if there is one.
fn selected(setting: &str) -> Option<&str> {
    let start = setting.find('[')? + 1;
    let end = start + setting[start..].find(']')?;
    Some(&setting[start..end])
}

/// What the machine's huge-page settings mean for checkpoints: `enabled` and `shmem` are
/// `/sys/kernel/mm/transparent_hugepage/{enabled,shmem_enabled}`, `mounts` is `/proc/mounts`. An
/// image written to a tmpfs with 2 MiB pages drains faster (on the H100 machine 42.6 GB/s from 16
/// threads against 31 for 4 KiB pages; eval/results/README.md, session 21). CRIU restores a
/// process's memory before it applies the process's `madvise` bits, so unless THP is `always` it
/// faults the memory in 4 KiB at a time (the MLP's 1.1 GB: CRIU's restore 0.42-0.51 s with
/// `always`, 0.65-0.72 s with `madvise`, same machine; session 25). Since session 27 possum's
/// CRIU plugin writes most of a `possum checkpoint` image's memory back itself (hostmem).
fn huge_pages(enabled: &str, shmem: &str, mounts: &str) -> String {
    let thp = selected(enabled).unwrap_or("unknown");
    let shm = selected(shmem).unwrap_or("unknown");
    let devshm_huge = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3
            && f[1] == "/dev/shm"
            && f[3]
                .split(',')
                .any(|o| o.starts_with("huge=") && o != "huge=never")
    });
    let hint = if devshm_huge || matches!(shm, "always" | "force") {
        "tmpfs images get 2 MiB pages"
    } else {
        "for images in memory, a tmpfs mounted with huge=always drains faster \
         (mount -t tmpfs -o huge=always,size=... none DIR)"
    };
    let restore_hint = if thp == "always" {
        ""
    } else {
        "; CRIU restores a job's memory faster with transparent huge pages `always` \
         (echo always > /sys/kernel/mm/transparent_hugepage/enabled): what possum's CRIU \
         plugin does not write back itself (`--engine driver` images, memory a forked worker \
         shares)"
    };
    format!(
        "transparent {thp}, shmem {shm}, /dev/shm huge: {}; {hint}{restore_hint}",
        if devshm_huge { "yes" } else { "no" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_are_read_from_the_kernel_settings_and_mounts() {
        let plain = "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n";
        let s = huge_pages(
            "always [madvise] never\n",
            "always within_size advise [never] deny force\n",
            plain,
        );
        assert!(
            s.starts_with("transparent madvise, shmem never, /dev/shm huge: no;"),
            "{s}"
        );
        assert!(s.contains("mounted with huge=always drains faster"), "{s}");
        assert!(s.contains("restores a job's memory faster"), "{s}");
        let huge = "tmpfs /dev/shm tmpfs rw,nosuid,nodev,huge=always 0 0\n";
        let s = huge_pages("[always] madvise never", "", huge);
        assert!(
            s.starts_with("transparent always, shmem unknown, /dev/shm huge: yes;"),
            "{s}"
        );
        assert!(s.ends_with("tmpfs images get 2 MiB pages"), "{s}");
    }
}
