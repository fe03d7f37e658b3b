//! Tests of `checkpoint`.
use super::plan::{job_runtime, possum_in};
use super::refusals::refuse_peers_outside;
use super::*;
use crate::gpu_runtimes::GpuRuntimes;
use possum_control::reply::StatusReply;

/// A process of the tree that exited after the tree was listed is left out, not an error.
#[test]
fn a_child_gone_since_the_tree_was_listed_is_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = std::process::Command::new("true").spawn().unwrap();
    c.wait().unwrap();
    let gone = c.id() as i32;
    let found = possum_in(&[gone], dir.path(), true).unwrap();
    assert!(found.is_empty(), "{found:?}");
}

fn with_communicators(comms: &[(&str, u32, u32)]) -> StatusReply {
    use possum_control::reply::{Communicator, PossumStatus, SessionStatus};
    let mut session = SessionStatus::default();
    session.collectives.communicators = comms
        .iter()
        .map(|&(id, nranks, ranks_here)| Communicator {
            id: id.into(),
            nranks,
            ranks_here,
        })
        .collect();
    StatusReply {
        possum: Some(PossumStatus {
            session: Some(session),
            ..PossumStatus::default()
        }),
        ..StatusReply::default()
    }
}

/// A communicator whose ranks are all in the tree passes (in one process or several); one
/// with a rank elsewhere is refused, naming the processes, the count and the id.
#[test]
fn a_communicator_with_ranks_outside_the_tree_is_refused() {
    let a = with_communicators(&[("aa", 2, 1), ("bb", 4, 4)]);
    let b = with_communicators(&[("aa", 2, 1)]);
    let none = StatusReply::default();
    refuse_peers_outside(&[(10, &a), (11, &b), (12, &none)]).unwrap();
    let c = with_communicators(&[("cc", 3, 1)]);
    let d = with_communicators(&[("cc", 3, 1)]);
    let e = refuse_peers_outside(&[(10, &a), (11, &b), (20, &c), (21, &d)]).unwrap_err();
    assert!(
        matches!(&e, PlanError::PeersOutside { id, nranks: 3, found: 2, pids }
            if id == "cc" && pids == &vec![20, 21]),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("processes 20, 21 of the job have ranks")
            && text.contains("of 3 ranks (id cc), of which only 2")
            && text.contains("nothing was done"),
        "{text}"
    );
}

fn status(runtime: Option<&str>) -> StatusReply {
    StatusReply {
        runtime: runtime.map(Into::into),
        ..StatusReply::default()
    }
}

const CUDA: GpuRuntimes = GpuRuntimes {
    cuda: true,
    hip: false,
};
const HIP: GpuRuntimes = GpuRuntimes {
    cuda: false,
    hip: true,
};
const BOTH: GpuRuntimes = GpuRuntimes {
    cuda: true,
    hip: true,
};

fn refusal(r: Result<GpuRuntime, PlanError>) -> HipRefusal {
    match r {
        Err(PlanError::Hip { pid: 42, why }) => why,
        other => panic!("not refused as HIP: {other:?}"),
    }
}

#[test]
fn a_hip_job_served_by_possum_is_taken_without_the_nvidia_driver() {
    let hip = status(Some(possum_control::reply::RUNTIME_HIP));
    let r = job_runtime(42, HIP, Engine::Possum, Some(&hip)).unwrap();
    assert_eq!(r, GpuRuntime::Hip);
    assert!(!r.has_nvidia_driver());
    // A CUDA job (with possum, or the driver's engine) keeps the driver.
    for (engine, s) in [(Engine::Possum, Some(status(None))), (Engine::Driver, None)] {
        let r = job_runtime(42, CUDA, engine, s.as_ref()).unwrap();
        assert_eq!(r, GpuRuntime::Cuda);
        assert!(r.has_nvidia_driver());
    }
    // possum's word decides, whatever the HIP runtime's file is named.
    let none = GpuRuntimes::default();
    assert_eq!(
        job_runtime(42, none, Engine::Possum, Some(&hip)).unwrap(),
        GpuRuntime::Hip
    );
    // A process with no GPU runtime mapped (yet) is left to the driver's checks, as before.
    assert_eq!(
        job_runtime(42, none, Engine::Possum, Some(&status(None))).unwrap(),
        GpuRuntime::Cuda
    );
}

#[test]
fn a_hip_job_possum_does_not_serve_is_refused_with_what_checkpoints_it() {
    let r = refusal(job_runtime(42, HIP, Engine::Possum, None));
    assert_eq!(r, HipRefusal::WithoutPossum);
    let text = PlanError::Hip { pid: 42, why: r }.to_string();
    for words in [
        "is a HIP (AMD GPU) job",
        "without possum loaded",
        "CRIU's amdgpu plugin",
        "criu dump --tree 42 ",
        "nothing was done",
    ] {
        assert!(text.contains(words), "{words:?}: {text}");
    }
    // possum loaded, but not serving the job on HIP.
    let cuda_status = status(None);
    let r = refusal(job_runtime(42, HIP, Engine::Possum, Some(&cuda_status)));
    assert_eq!(r, HipRefusal::NotServed);
    let text = PlanError::Hip { pid: 42, why: r }.to_string();
    assert!(text.contains("names no `hip` runtime"), "{text}");
    assert!(text.contains("CRIU's amdgpu plugin"), "{text}");
    // The driver's engine: there is no NVIDIA driver to checkpoint it.
    let r = refusal(job_runtime(42, HIP, Engine::Driver, None));
    assert_eq!(r, HipRefusal::DriverEngine);
    let text = PlanError::Hip { pid: 42, why: r }.to_string();
    assert!(
        text.contains("--engine driver is NVIDIA's driver checkpoint"),
        "{text}"
    );
    assert!(text.contains("criu dump --tree 42 "), "{text}");
}

#[test]
fn a_process_mixing_cuda_and_hip_is_refused_whatever_serves_it() {
    let hip = status(Some(possum_control::reply::RUNTIME_HIP));
    let cases = [
        (BOTH, Engine::Possum, Some(&hip)),
        (BOTH, Engine::Possum, None),
        (BOTH, Engine::Driver, None),
        // possum says HIP, and NVIDIA's libcuda is loaded.
        (CUDA, Engine::Possum, Some(&hip)),
    ];
    for (mapped, engine, s) in cases {
        let r = refusal(job_runtime(42, mapped, engine, s));
        assert_eq!(r, HipRefusal::Mixed, "{mapped:?} {engine:?}");
        let text = PlanError::Hip { pid: 42, why: r }.to_string();
        assert!(text.contains("mixes CUDA and HIP"), "{text}");
        assert!(text.contains("nothing was done"), "{text}");
    }
}

fn dump_failed(message: &str) -> CriuError {
    CriuError::Failed {
        op: "dump",
        errno: None,
        message: Some(message.into()),
        log: None,
        log_tail: String::new(),
    }
}

#[test]
fn a_dump_refused_for_an_established_tcp_connection_names_the_flag() {
    let e = HoldError::from(dump_failed(
        "Error (criu/sk-inet.c:191): inet: Connected TCP socket, consider using \
         --tcp-established option.",
    ));
    assert!(matches!(e, HoldError::TcpEstablished(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("checkpoint it with --tcp-established"),
        "{e}"
    );
    // CRIU's own text stays in the chain.
    let source = std::error::Error::source(&e).unwrap().to_string();
    assert!(source.contains("Connected TCP socket"), "{source}");

    let e = HoldError::from(dump_failed(
        "Error (criu/sockets.c:628): sockets: Can't get 1:16 opt: Operation not supported",
    ));
    assert!(matches!(e, HoldError::CriuTooOldForTcp(_)), "{e:?}");
    assert!(e.to_string().contains("Linux 6.16"), "{e}");

    let e = HoldError::from(dump_failed(
        "Error (criu/sk-unix.c:881): unix: Can't dump half of stream unix connection. \
         name: /run/app.sock; peer name: (null)",
    ));
    assert!(matches!(e, HoldError::UnixStreamOutside(_)), "{e:?}");
    assert!(e.to_string().contains("unix stream connection"), "{e}");

    let e = HoldError::from(dump_failed("Can't seize 42"));
    assert!(matches!(e, HoldError::Dump(_)), "{e:?}");
    assert!(!e.to_string().contains("--tcp-established"), "{e}");
}
