//! Memory possum maps is reachable from every peer device, as `cudaMalloc`'s is once peer access
//! is enabled: both map paths (`CudaDevice::map` and `share::SharedMem::map`) give read/write
//! access to the owning device and to every device `cuDeviceCanAccessPeer` says can reach it.
//!
//! Against `testdata/fake-libcuda.c` (built here with `cc`; without a C compiler each test prints
//! "SKIPPED: ..." and returns), which records the devices each mapping was given access to
//! (`fake_access_mask`). The driver is found when the process starts, so each case runs this
//! binary again as a child (`helper_map_and_report`, selected with `--exact`, its mode in
//! `POSSUM_PEER_HELPER`) with the fake first on `LD_LIBRARY_PATH` and `FAKE_CUDA_DEVICES` set.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use possum_cuda::share::ShareDevice;
use possum_cuda::CudaDevice;
use possum_engine::device::Device;

const HELPER_ENV: &str = "POSSUM_PEER_HELPER";

/// The directory holding the fake driver as `libcuda.so.1`, built once per run; `None` (said on
/// stderr) without a C compiler.
fn fake_dir(test: &str) -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = DIR
        .get_or_init(|| {
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata/fake-libcuda.c");
            let dir = std::env::temp_dir().join(format!("possum-fake-peer-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let ok = Command::new("cc")
                .args(["-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-o"])
                .arg(dir.join("libcuda.so.1"))
                .arg(src)
                .status()
                .is_ok_and(|s| s.success());
            ok.then_some(dir)
        })
        .as_ref();
    if dir.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: no C compiler to build testdata/fake-libcuda.c [{test}]"
        );
    }
    dir
}

/// The access masks (bit d: device d) the child reports for a buffer mapped on device 0 by
/// `CudaDevice::map` and by `SharedMem::map`, with `devices` fake devices; `refused`: the driver
/// refuses to give access to more than one device at a time.
fn masks(dir: &std::path::Path, devices: usize, refused: bool) -> (u32, u32) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    if refused {
        cmd.env("FAKE_CUDA_PEERS_REFUSED", "1");
    } else {
        cmd.env_remove("FAKE_CUDA_PEERS_REFUSED");
    }
    let out = cmd
        .args([
            "--exact",
            "helper_map_and_report",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, "map")
        .env("LD_LIBRARY_PATH", dir)
        .env("FAKE_CUDA_DEVICES", devices.to_string())
        .env_remove("FAKE_CUDA_NODEV")
        .env_remove("POSSUM_LIBCUDA")
        .output()
        .expect("run the helper");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| -> u32 {
        text.lines()
            // The harness's "test helper_map_and_report ... " may come first on the line.
            .find_map(|l| l.split_once(key).map(|(_, v)| v))
            .unwrap_or_else(|| panic!("no {key:?} in the helper's output:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    };
    (field("device mask "), field("shared mask "))
}

#[test]
fn mapped_memory_is_reachable_from_every_peer() {
    let Some(dir) = fake_dir("mapped_memory_is_reachable_from_every_peer") else {
        return;
    };
    assert_eq!(
        masks(dir, 2, false),
        (0b11, 0b11),
        "two devices: both reach it"
    );
    assert_eq!(
        masks(dir, 3, false),
        (0b111, 0b111),
        "three devices: all reach it"
    );
    assert_eq!(masks(dir, 1, false), (0b1, 0b1), "one device: only itself");
    // A driver that refuses the peers: the memory is still mapped, for its own device.
    assert_eq!(
        masks(dir, 2, true),
        (0b1, 0b1),
        "peers refused: only itself"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The fake driver's record of the devices with access to the mapping at `va`.
fn fake_access_mask(va: u64) -> u32 {
    // SAFETY: "libcuda.so.1" is the fake driver this process already loaded (the child runs with
    // its directory first on LD_LIBRARY_PATH), so this only takes another reference to it; its
    // initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.expect("the fake driver");
    // SAFETY: the fake exports `unsigned fake_access_mask(unsigned long long va)`, which only
    // reads its mapping table under its lock; the symbol does not outlive `lib`.
    unsafe {
        let f = lib
            .get::<unsafe extern "C" fn(u64) -> u32>(b"fake_access_mask")
            .expect("the fake driver exports fake_access_mask");
        f(va)
    }
}

/// Run as a child by [`masks`]: maps a buffer on device 0 both ways and prints each one's access
/// mask. Does nothing without `POSSUM_PEER_HELPER`.
#[test]
fn helper_map_and_report() {
    if std::env::var_os(HELPER_ENV).is_none() {
        return;
    }
    let dev = CudaDevice::new(0).expect("open device 0 of the fake driver");
    let g = dev.granularity();
    let va = dev.reserve(g).unwrap();
    dev.map(va, g).unwrap();
    println!("device mask {}", fake_access_mask(va.0));
    dev.unmap(va, g).unwrap();
    dev.unreserve(va, g).unwrap();

    let share = ShareDevice::open(0).expect("open device 0 for shareable memory");
    let mem = share.create(share.granularity()).unwrap();
    let res = share.reserve(share.granularity()).unwrap();
    let mapped = mem.map(&res, 0).unwrap();
    println!("shared mask {}", fake_access_mask(res.va()));
    drop(mapped);
}
