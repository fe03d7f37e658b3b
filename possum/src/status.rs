//! `possum status`: what possum manages in a running job.

use anyhow::Result;
use clap::Args;
use possum_control::reply::{KeeperStatus, SessionStatus, StatusReply};
use possum_control::Request;
use serde::Deserialize;
use serde_json::Value;

use crate::trace::{ask, JobArgs};

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The job's process id.
    pub pid: u32,
    /// Print the job's answer as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub job: JobArgs,
}

pub fn run(a: &StatusArgs) -> Result<bool> {
    let reply = ask(a.pid, &a.job, &Request::Status)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
    } else {
        print!("{}", summary(a.pid, &reply));
    }
    Ok(true)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What possum manages, in words: per device engine its buffers, bytes, resident and dirty bytes
/// and phase; the allocations it does not manage, by driver call; whether a checkpoint holds the
/// job; how possum sees its operations.
fn managed(v: &StatusReply) -> String {
    let Some(p) = &v.possum else {
        return String::new();
    };
    let mut s = String::new();
    for e in &p.engines {
        let g = &e.engine;
        // Writes are recorded only while the engine tracks (a checkpoint open to its restore).
        let written = if g.tracking == Some(false) {
            "writes not tracked: no checkpoint open".to_string()
        } else {
            format!("{} written since the last pre-copy", gib(g.dirty_bytes))
        };
        s.push_str(&format!(
            "  device {}: {} buffers, {} ({} resident, {written}), phase {}\n",
            e.device,
            g.buffers,
            gib(g.bytes.unwrap_or(0)),
            gib(g.resident_bytes),
            g.phase.as_deref().unwrap_or("?")
        ));
        if let Some(k) = &e.keeper {
            s.push_str(&keeper(k));
        }
    }
    if let Some(vmm) = p.vmm.as_ref().filter(|v| v.serving) {
        s.push_str(&format!(
            "  the job's own virtual memory (POSSUM_SERVE_VMM): {} pieces mapped as engine \
             buffers, {} handles of possum's live, {} exported to other processes\n",
            vmm.pieces_mapped_now, vmm.handles_live, vmm.handles_shared
        ));
        if vmm.left_to_driver > 0 {
            s.push_str(&format!(
                "    {} cuMemCreate left to the driver (properties possum does not serve; the \
                 first: {})\n",
                vmm.left_to_driver,
                vmm.left_to_driver_first_prop.as_deref().unwrap_or("?")
            ));
        }
    }
    if let Some(i) = p.imports.as_ref().filter(|i| i.imported > 0) {
        s.push_str(&format!(
            "  memory other processes shared with it: {} imported through the keeper, {} mapped \
             now; released {} times for checkpoints (mapped again at each resume)\n",
            i.imported, i.mapped_now, i.released_at_checkpoints
        ));
    }
    if let Some(pools) = p.pools.as_ref().filter(|p| p.serving) {
        s.push_str(&format!(
            "  stream-ordered allocations (POSSUM_SERVE_POOLS): {} blocks, {} in {} engine \
             slabs, {} waiting for their stream; {} of {} served by a block freed on their \
             stream\n",
            pools.blocks_live,
            gib(pools.bytes_live),
            pools.slabs,
            pools.blocks_pending_free,
            pools.reused_on_their_stream,
            pools.allocations_served
        ));
    }
    if let Some(u) = &p.unmanaged {
        let fate = if v.is_hip() {
            "a checkpoint refuses the job while it holds any"
        } else {
            "the driver's checkpoint takes them"
        };
        s.push_str(&format!(
            "  not managed: {} allocations, {} ({fate})\n",
            u.allocations,
            gib(u.bytes)
        ));
        for (kind, k) in &u.by_kind {
            let managed = if kind == "cuMemAllocManaged" {
                " (managed memory: no checkpoint can save it)"
            } else {
                ""
            };
            s.push_str(&format!(
                "    {kind}: {} allocations, {}{managed}\n",
                k.allocations,
                gib(k.bytes)
            ));
        }
    }
    if let Some(ss) = &p.session {
        let doing = if ss.paused {
            "holding the job (released)"
        } else {
            ss.busy.as_deref().unwrap_or("none running")
        };
        if v.is_hip() {
            s.push_str(&format!("  checkpoint: {doing}\n"));
        } else {
            s.push_str(&format!(
                "  checkpoint: {doing}; CUPTI {}\n",
                if ss.cupti_attached {
                    "attached"
                } else {
                    "not attached"
                }
            ));
        }
        s.push_str(&hooks(v, ss));
        let c = &ss.collectives;
        if c.launched > 0 || c.barrier.is_some() {
            s.push_str(&format!(
                "  collectives (NCCL's kernels): {} launched{}\n",
                c.launched,
                match c.barrier {
                    Some(at) => format!(
                        "; held from launch {at} for a checkpoint's cut ({} threads waiting)",
                        c.held
                    ),
                    None => String::new(),
                }
            ));
        }
    }
    s
}

/// The keeper an engine's memory comes from: what it holds, or that it does not answer.
fn keeper(k: &KeeperStatus) -> String {
    let n = |x: Option<u64>| x.unwrap_or(0);
    if k.reachable != Some(true) {
        return format!(
            "    {}: a checkpoint copies this device's buffers\n",
            k.name.as_deref().unwrap_or("the keeper does not answer")
        );
    }
    let mut s = format!(
        "    memory kept by {}: {} allocations, {} ({} detached); {} of the engine's mappings \
         there, {} its own\n",
        k.name.as_deref().unwrap_or("a keeper"),
        n(k.allocations),
        gib(n(k.bytes)),
        gib(n(k.retained_bytes)),
        n(k.mappings_kept),
        n(k.mappings_own)
    );
    if let Some(sp) = &k.spare {
        s.push_str(&format!(
            "    spare image memory of that keeper (kept checkpoints drain into it): {sp}\n"
        ));
    }
    s
}

/// How possum sees the job's operations (`hooks`, `possum.session.hooks_live`), and what that
/// means for a checkpoint; the entry points' statistics when they are wrapped.
fn hooks(v: &StatusReply, ss: &SessionStatus) -> String {
    let cupti = ss.cupti_attached;
    // Libraries older than the entry points' hooks had only CUPTI's.
    let live = ss.hooks_live.unwrap_or(cupti);
    let mode = v
        .hooks
        .as_deref()
        .unwrap_or(if cupti { "cupti" } else { "?" });
    let what = match (live, cupti) {
        (_, true) => {
            "CUPTI attached: NVIDIA's driver refuses to checkpoint this job (only --gpu-only \
             or --engine driver)"
        }
        (true, false) => {
            "live: a checkpoint pre-copies while the job runs, holds it at the op gate, and its \
             buffers come back on demand"
        }
        (false, false) => {
            "not live: a checkpoint parks the job's threads, copies every buffer while they are \
             parked, and brings every buffer back before they run on"
        }
    };
    let mut s = format!("  hooks: {mode} ({what})\n");
    if let Some(e) = v.entry.as_ref().filter(|_| mode == "entry") {
        s.push_str(&format!(
            "    entry points: {} wrapped; handed out {} times by cuGetProcAddress, {} by dlsym; \
             {} other cuGetProcAddress answers; {} unknown versions of wrapped names\n",
            e.wrapped,
            e.swapped_proc_address,
            e.swapped_dlsym,
            e.passed_proc_address,
            e.unmatched.len()
        ));
    }
    s
}

/// What possum's HIP front end saw, for a HIP job (`possum.hip`); nothing otherwise.
fn hip_front_end(v: &Value) -> String {
    let h = &v["possum"]["hip"];
    if !h.is_object() {
        return String::new();
    }
    let n = |k: &str| h[k].as_u64().unwrap_or(0);
    format!(
        "  HIP front end on {}: {} launches ({} of kernels whose layout is unknown: taken to \
         write every buffer), {} graph launches, {} copies, {} memsets; {} allocations served, \
         {} freed\n",
        h["runtime"].as_str().unwrap_or("?"),
        n("launches"),
        n("opaque_launches"),
        n("graph_launches"),
        n("copies"),
        n("memsets"),
        n("served_allocs"),
        n("served_frees")
    )
}

/// A summary of what possum manages, then one line per top-level key, the name padded to 20
/// columns: scalars as they are, arrays as a count, objects as compact JSON.
fn summary(pid: u32, v: &Value) -> String {
    let mut s = format!("possum status: process {pid}\n");
    // The typed view for the words; the job's JSON itself for the key lines. A reply that does
    // not fit the typed view still gets its key lines.
    s.push_str(&managed(&StatusReply::deserialize(v).unwrap_or_default()));
    s.push_str(&hip_front_end(v));
    let Value::Object(m) = v else {
        s.push_str(&format!("  {v}\n"));
        return s;
    };
    for (k, v) in m {
        let shown = match v {
            Value::String(x) => x.clone(),
            Value::Array(a) => format!("{} items", a.len()),
            other => other.to_string(),
        };
        s.push_str(&format!("  {k:<20}{shown}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that `s` says each of `parts`.
    fn says(s: &str, parts: &[&str]) {
        for p in parts {
            assert!(s.contains(p), "{p:?} is not in:\n{s}");
        }
    }

    #[test]
    fn summary_has_a_line_per_key() {
        let v = serde_json::json!({"phase": "idle", "buffers": 3, "list": [1, 2]});
        let s = summary(7, &v);
        assert!(s.starts_with("possum status: process 7\n"), "{s}");
        says(
            &s,
            &[
                "  phase               idle\n",
                "  buffers             3\n",
                "  list                2 items\n",
            ],
        );
    }

    #[test]
    fn summary_says_what_possum_manages() {
        let v = serde_json::json!({"possum": {
            "engines": [{"device": 0, "engine": {"buffers": 8, "bytes": 3u64 << 30,
                "resident_bytes": 1u64 << 30, "dirty_bytes": 1u64 << 29, "phase": "released"}}],
            "unmanaged": {"allocations": 4, "bytes": 64u64 << 20},
            "vmm": {"serving": true, "pieces_mapped_now": 2, "handles_live": 3, "handles_shared": 1,
                    "left_to_driver": 1, "left_to_driver_first_prop": "0100"},
            "imports": {"imported": 2, "live": 2, "mapped_now": 1, "released_at_checkpoints": 3},
            "pools": {"serving": true, "blocks_live": 5, "bytes_live": 1u64 << 30, "slabs": 2,
                      "blocks_pending_free": 1, "allocations_served": 9,
                      "reused_on_their_stream": 4},
            "session": {"paused": true, "busy": null, "cupti_attached": true,
                        "collectives": {"launched": 41, "barrier": 42, "held": 1}}}});
        let s = summary(7, &v);
        says(
            &s,
            &[
                "collectives (NCCL's kernels): 41 launched; held from launch 42 for a checkpoint's cut (1 threads waiting)",
                "own virtual memory (POSSUM_SERVE_VMM): 2 pieces mapped as engine buffers, 3 handles of possum's live, 1 exported to other processes",
                "memory other processes shared with it: 2 imported through the keeper, 1 mapped now; released 3 times for checkpoints",
                "1 cuMemCreate left to the driver (properties possum does not serve; the first: 0100)",
                "(POSSUM_SERVE_POOLS): 5 blocks, 1.00 GiB in 2 engine slabs, 1 waiting for their stream; 4 of 9 served by a block freed on their stream",
                "device 0: 8 buffers, 3.00 GiB (1.00 GiB resident, 0.50 GiB written since",
                "phase released",
                "not managed: 4 allocations, 0.06 GiB",
            ],
        );
        let mut idle = v.clone();
        idle["possum"]["engines"][0]["engine"]["tracking"] = false.into();
        let s = summary(7, &idle);
        says(
            &s,
            &[
                "(1.00 GiB resident, writes not tracked",
                "checkpoint: holding the job (released); CUPTI attached",
                "hooks: cupti (CUPTI attached: NVIDIA's driver refuses",
            ],
        );
    }

    #[test]
    fn summary_of_a_hip_job_says_what_its_front_end_saw() {
        let v = serde_json::json!({"pid": 9, "hooks": "entry", "runtime": "hip", "possum": {
            "engines": [{"device": 0, "engine": {"bytes": 1048576, "buffers": 3}}],
            "unmanaged": {"allocations": 1, "bytes": 4096,
                          "by_kind": {"hipMallocManaged": {"allocations": 1, "bytes": 4096}}},
            "session": {"paused": false, "hooks_live": true},
            "hip": {"runtime": "/opt/rocm/lib/libamdhip64.so", "launches": 12,
                    "opaque_launches": 2, "graph_launches": 3, "copies": 4, "memsets": 5,
                    "served_allocs": 6, "served_frees": 1}}});
        let s = summary(9, &v);
        says(
            &s,
            &[
                "not managed: 1 allocations, 0.00 GiB (a checkpoint refuses the job",
                "  checkpoint: none running\n",
            ],
        );
        assert!(!s.contains("CUPTI"), "{s}");
        assert!(
            s.contains("HIP front end on /opt/rocm/lib/libamdhip64.so: 12 launches (2 of kernels")
                && s.contains(
                    "3 graph launches, 4 copies, 5 memsets; 6 allocations served, 1 freed"
                ),
            "{s}"
        );
    }

    #[test]
    fn summary_says_how_possum_sees_the_job() {
        let v = serde_json::json!({"hooks": "entry",
            "entry": {"wrapped": 120, "swapped_dlsym": 3, "swapped_proc_address": 40,
                      "passed_proc_address": 500, "unmatched": [{"symbol": "cuLaunchKernel"}]},
            "possum": {
            "unmanaged": {"allocations": 3, "bytes": 3u64 << 30, "by_kind": {
                "cuMemMap": {"allocations": 2, "bytes": 2u64 << 30},
                "cuMemAllocManaged": {"allocations": 1, "bytes": 1u64 << 30}}},
            "session": {"paused": false, "busy": null, "cupti_attached": false,
                        "hooks_live": true}}});
        let s = summary(7, &v);
        says(&s, &["not managed: 3 allocations, 3.00 GiB"]);
        // A job that launched no collective says nothing of them.
        assert!(!s.contains("collectives"), "{s}");
        says(
            &s,
            &[
                "    cuMemAllocManaged: 1 allocations, 1.00 GiB (managed memory",
                "    cuMemMap: 2 allocations, 2.00 GiB\n",
                "CUPTI not attached",
                "hooks: entry (live: a checkpoint pre-copies",
                "entry points: 120 wrapped; handed out 40 times by cuGetProcAddress, 3 by dlsym; 500 other cuGetProcAddress answers; 1 unknown versions",
            ],
        );
        let mut off = v.clone();
        off["hooks"] = "off".into();
        off["possum"]["session"]["hooks_live"] = false.into();
        let s = summary(7, &off);
        says(&s, &["hooks: off (not live: a checkpoint parks"]);
        assert!(!s.contains("entry points:"), "{s}");
    }
}
