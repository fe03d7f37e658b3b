//! The simulated HIP runtime and its test program: the program's output against digests computed
//! here from what each step must leave in memory, the addresses it is given against the arena,
//! and the kernels the runtime knows against the code object's metadata (as possum's analyzer
//! reads it). Without a C compiler each test prints "SKIPPED: ..." and returns.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use possum_analyzer::amdgpu::{kernels, ArgKind};
use possum_analyzer::{Param, ParamLayout};
use possum_hip::{build_job, build_runtime, kernels_code_object, BuildError};

/// Where the tests put the arena (not the runtime's default, to see that it is honoured).
const VA_BASE: u64 = 0x7d00_0000_0000;
/// Elements of the program's buffers (`N` in hip-sim-job.c).
const N: usize = 3000;
/// The runtime's allocation granularity (`GRANULARITY` in fake-libamdhip64.c).
const GRANULARITY: usize = 64 << 10;

/// The runtime and the program, built into a directory removed when it is dropped; `None` (said
/// on stderr) without a C compiler.
fn job_or_skip(test: &str) -> Option<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::Builder::new()
        .prefix("possum-hip-")
        .tempdir()
        .expect("temp dir");
    match build_runtime(dir.path()).and_then(|_| build_job(dir.path())) {
        Ok(job) => Some((dir, job)),
        Err(BuildError::NoCompiler(_)) => {
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: no C compiler to build the simulated HIP runtime [{test}]"
            );
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Runs the program on the simulated runtime with `env` (and nothing of this process's
/// `FAKE_HIP_*`).
fn run(job: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(job);
    cmd.arg(kernels_code_object());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("FAKE_HIP_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    cmd.output().expect("the program runs")
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn digest_u32(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    format!("{:016x}", fnv(&bytes))
}

fn digest_f32(values: &[f32]) -> String {
    digest_u32(&values.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
}

/// What each step of hip-sim-job.c must print, computed from what the step does.
fn reference(devices: usize) -> Vec<String> {
    let mut lines = vec![format!("devices {devices} {}", devices - 1)];

    // fill: 0xa5a5a5a5 over all N, then 7 over the first two blocks of 256 work-items.
    let fill: Vec<u32> = (0..N)
        .map(|i| if i < 512 { 7 } else { 0xa5a5_a5a5 })
        .collect();
    lines.push(format!("fill {}", digest_u32(&fill)));

    // streams: y = 3x + y, copied on the other stream after the event.
    let y: Vec<f32> = (0..N)
        .map(|i| 3.0 * (i % 97) as f32 + ((i % 13) as f32 - 6.0))
        .collect();
    lines.push(format!("streams {}", digest_f32(&y)));

    // pool: the freed first block is handed out again; p2 is 0x11111111 with 1000 words of
    // 0x22222222 copied in at 500.
    let pool: Vec<u32> = (0..N)
        .map(|i| {
            if (500..1500).contains(&i) {
                0x2222_2222
            } else {
                0x1111_1111
            }
        })
        .collect();
    lines.push(format!("pool 1 {}", digest_u32(&pool)));

    // graph: nothing runs at capture; three launches of y = 2x + y from y = 1.
    lines.push(format!("graph-captured {}", digest_f32(&vec![1.0; N])));
    let graph: Vec<f32> = (0..N)
        .map(|i| {
            let x = (i % 7) as f32;
            (0..3).fold(1.0f32, |y, _| 2.0 * x + y)
        })
        .collect();
    lines.push(format!("graph {}", digest_f32(&graph)));

    // vmm: the two allocations swapped; hipMemRelease of a mapped one is hipErrorIllegalState.
    let words = GRANULARITY / 4;
    let vmm: Vec<u32> = (0..2 * words)
        .map(|i| if i < words { 0x4444_4444 } else { 0x3333_3333 })
        .collect();
    lines.push(format!("vmm {GRANULARITY} 401 {}", digest_u32(&vmm)));

    // procaddress: hipMemsetAsync through the pointer; an unknown name is
    // hipErrorInvalidValue with HIP_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND and a null pointer.
    lines.push(format!("procaddress 0 {:016x}", fnv(&vec![0x5a; N * 4])));
    lines.push("procaddress-missing 1 1 1".into());

    // threads: four threads' last fills (value + 49), their digests XORed.
    let threads = (1..=4u32)
        .map(|i| {
            let words = vec![0x1000 * i + 49; N];
            u64::from_str_radix(&digest_u32(&words), 16).unwrap()
        })
        .fold(0, |d, x| d ^ x);
    lines.push(format!("threads {threads:016x}"));

    // errors: hipErrorInvalidDevice, hipErrorInvalidValue, hipErrorNotFound,
    // hipErrorInvalidImage; the last error, then none.
    lines.push("errors 101 1 500 200 200 0".into());
    lines.push("errstr hipErrorInvalidValue|invalid argument".into());
    lines
}

/// The output's lines, less the last (the addresses), which is returned parsed.
fn split(out: &Output) -> (Vec<String>, Vec<u64>) {
    assert!(
        out.status.success(),
        "the program failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout.clone()).expect("UTF-8 output");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let last = lines.pop().expect("some output");
    let addrs = last
        .strip_prefix("addresses ")
        .unwrap_or_else(|| panic!("last line {last:?}"))
        .split(' ')
        .map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).expect("hex address"))
        .collect();
    (lines, addrs)
}

#[test]
fn program_output_matches_the_reference() {
    let Some((_dir, job)) = job_or_skip("program_output_matches_the_reference") else {
        return;
    };
    let base = format!("{VA_BASE:#x}");
    for devices in [1, 2] {
        let n = devices.to_string();
        let out = run(
            &job,
            &[("FAKE_HIP_DEVICES", &n), ("FAKE_HIP_VA_BASE", &base)],
        );
        let (lines, _) = split(&out);
        assert_eq!(lines, reference(devices), "with {devices} device(s)");
    }
}

#[test]
fn device_addresses_are_the_same_in_every_run() {
    let Some((_dir, job)) = job_or_skip("device_addresses_are_the_same_in_every_run") else {
        return;
    };
    let base = format!("{VA_BASE:#x}");
    let env = [("FAKE_HIP_VA_BASE", base.as_str())];
    let (_, first) = split(&run(&job, &env));
    let (_, second) = split(&run(&job, &env));
    assert_eq!(first, second);
    // a, x, y, c, p1, p2, p3, gx, gy, gz, va (hip-sim-job.c's order).
    assert_eq!(first.len(), 11);
    assert_eq!(first[0], VA_BASE, "the first allocation opens the arena");
    assert!(first
        .iter()
        .all(|&a| (VA_BASE..VA_BASE + (64 << 30)).contains(&a)));
    assert_eq!(first[6], first[4], "the pool reuses the freed block");
    let mut distinct = first.clone();
    distinct.remove(6);
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 10, "{first:x?}");
    // hipMalloc's blocks and the VMM reservation are aligned to the granularity.
    for i in [0, 7, 8, 9, 10] {
        assert_eq!(first[i] % GRANULARITY as u64, 0, "{:#x}", first[i]);
    }

    // The runtime's default arena base when none is given.
    let (_, default) = split(&run(&job, &[]));
    assert_eq!(default[0], 0x7e00_0000_0000);
    assert_eq!(
        default.iter().map(|a| a - default[0]).collect::<Vec<_>>(),
        first.iter().map(|a| a - first[0]).collect::<Vec<_>>(),
        "the same layout at another base"
    );
}

#[test]
fn no_device_fails_at_init() {
    let Some((_dir, job)) = job_or_skip("no_device_fails_at_init") else {
        return;
    };
    let out = run(&job, &[("FAKE_HIP_NODEV", "1")]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hipInit(0): hipErrorNoDevice (100)"), "{err}");
    assert!(out.stdout.is_empty());
}

/// A kernel the runtime runs, as fake-libamdhip64.c's `kernels[]` packs its arguments.
struct SimKernel {
    name: &'static str,
    /// (offset, size) of each explicit argument.
    args: &'static [(u32, u32)],
    /// The explicit bytes a launch's `extra` buffer must hold.
    explicit: u32,
}

const SIM_KERNELS: &[SimKernel] = &[
    SimKernel {
        name: "fill_u32",
        args: &[(0, 8), (8, 4), (12, 4)],
        explicit: 16,
    },
    SimKernel {
        name: "axpy_f32",
        args: &[(0, 8), (8, 8), (16, 4), (20, 4)],
        explicit: 24,
    },
    SimKernel {
        name: "copy_u32",
        args: &[(0, 8), (8, 8), (16, 4)],
        explicit: 20,
    },
];

#[test]
fn the_simulated_kernels_match_the_code_object() {
    let elf = std::fs::read(kernels_code_object()).expect("the code object");
    let ks = kernels(&elf).expect("the code object reads");
    let names: Vec<&str> = ks.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(names, ["fill_u32", "axpy_f32", "copy_u32"]);
    for (k, sim) in ks.iter().zip(SIM_KERNELS) {
        let (name, args, size) = (sim.name, sim.args, &sim.explicit);
        assert_eq!(k.name, *name);
        assert_eq!(
            k.layout(),
            ParamLayout::new(
                args.iter()
                    .map(|&(offset, size)| Param { offset, size })
                    .collect()
            ),
            "{name}"
        );
        assert_eq!(k.explicit_size(), *size, "{name}");
        // Code object v5: the runtime's hidden arguments follow, 256 bytes of them.
        assert!(k.hidden_args().count() > 0, "{name}");
        assert!(k.kernarg_size >= size + 256, "{name}: {}", k.kernarg_size);
        assert!(k
            .hidden_args()
            .all(|a| matches!(a.kind, ArgKind::Hidden(_)) && a.offset >= *size));
    }
}
