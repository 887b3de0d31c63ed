//! Golden key vectors: the key scheme (docs/formats.md §1) is fixed across processes, nodes and
//! versions. The same vectors are checked from Python in `tests/test_keys.py`.

use kvtier_core::{block_keys, Dtype, Geometry, Namespace};

fn golden_namespace() -> Namespace {
    Namespace {
        model_id: "meta-llama/Llama-3.1-8B".into(),
        geometry: Geometry::new(32, 8, 128, Dtype::Bf16, 16, vec![]).unwrap(),
        layout_version: 1,
        cache_salt: String::new(),
        rank: 0,
    }
}

const GOLDEN_NAMESPACE: u128 = 0x6ffd1453ff86d5d21d739dc2b13648af;
const GOLDEN_KEYS: [u128; 3] = [
    0xc5a1590c4528e869a356a9c21f87a0d1,
    0x658200a4d269db61b071065e284625c7,
    0x8e9080ff48d1f6ada1dfc49f90cdde3c,
];

#[test]
fn golden_vectors_are_stable() {
    let ns = golden_namespace().hash().unwrap();
    let tokens: Vec<u32> = (0..48).collect();
    let keys = block_keys(ns, &tokens, 16, &[]).unwrap();
    assert_eq!(ns, GOLDEN_NAMESPACE, "namespace hash changed: {ns:#034x}");
    assert_eq!(keys, GOLDEN_KEYS, "block keys changed: {keys:#034x?}");
}
