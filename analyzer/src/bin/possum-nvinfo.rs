//! `possum-nvinfo CUBIN`: prints the kernel parameter layouts of a cubin, read from its
//! `.nv.info.<kernel>` sections, one JSON line per kernel:
//! `{"kernel": name, "params": [[offset, size], ...]}`. For comparing with `cuobjdump -elf`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, path] = args.as_slice() else {
        eprintln!("usage: possum-nvinfo CUBIN");
        return ExitCode::from(2);
    };
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("possum-nvinfo: cannot read {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match possum_analyzer::param_layouts(&bytes) {
        Ok(layouts) => {
            for (kernel, layout) in layouts {
                let params: Vec<[u32; 2]> =
                    layout.params.iter().map(|p| [p.offset, p.size]).collect();
                println!(
                    "{}",
                    serde_json::json!({"kernel": kernel, "params": params})
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("possum-nvinfo: {path}: {e}");
            ExitCode::FAILURE
        }
    }
}
