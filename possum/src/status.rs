//! `possum status`: what possum manages in a running job.

use anyhow::Result;
use clap::Args;
use possum_control::Request;
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

/// One line per top-level key, the name padded to 20 columns: scalars as they are, arrays as a
/// count, objects as compact JSON.
fn summary(pid: u32, v: &Value) -> String {
    let mut s = format!("possum status: process {pid}\n");
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

    #[test]
    fn summary_has_a_line_per_key() {
        let v = serde_json::json!({"phase": "idle", "buffers": 3, "list": [1, 2]});
        let s = summary(7, &v);
        assert!(s.starts_with("possum status: process 7\n"), "{s}");
        assert!(s.contains("  phase               idle\n"), "{s}");
        assert!(s.contains("  buffers             3\n"), "{s}");
        assert!(s.contains("  list                2 items\n"), "{s}");
    }
}
