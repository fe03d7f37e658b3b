//! Parameter layouts of a real cubin (tests/data/params.cu built by nvcc for sm_90), as
//! `cuobjdump -elf` lists them: legacy KPARAM_INFO records and, for the kernel with an 8000-byte
//! by-value struct, KPARAM_INFO_V2 records.

use possum_analyzer::{param_layouts, Param, ParamLayout};

fn layout(params: &[(u32, u32)]) -> ParamLayout {
    ParamLayout::new(
        params
            .iter()
            .map(|&(offset, size)| Param { offset, size })
            .collect(),
    )
}

#[test]
fn nvcc_sm90_cubin_matches_cuobjdump() {
    let bytes = include_bytes!("data/params_sm90.cubin");
    let got = param_layouts(bytes).expect("parses");
    let want = [
        (
            "_Z2k1iPf1ScS_",
            layout(&[(0, 4), (8, 8), (16, 24), (40, 1), (48, 8)]),
        ),
        ("_Z2k2v", layout(&[])),
        ("_Z2k33BigPi", layout(&[(0, 8000), (8000, 8)])),
        ("_Z2k4dsPx", layout(&[(0, 8), (8, 2), (16, 8)])),
    ];
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (name, l) in want {
        assert_eq!(got.get(name), Some(&l), "{name}");
    }
    // k1(int, float*, S{float*, int, double*}, char, float*): pointer words at 8, 16, 24, 32, 48.
    let offsets: Vec<u32> = got["_Z2k1iPf1ScS_"]
        .pointer_slots()
        .iter()
        .map(|s| s.offset)
        .collect();
    assert_eq!(offsets, vec![8, 16, 24, 32, 48]);
}
