//! A store serves one namespace: another namespace's hash is an error, and keys computed in
//! another namespace (other model, other tenant salt) never hit.

use crate::common;
use common::*;
use kvtier_core::block_keys;
use kvtier_store::StoreError;

#[test]
fn wrong_namespace_hash_is_an_error_everywhere() {
    let s = store(8);
    let other = namespace("test-model", "tenant-b").hash().unwrap();
    let k = keys(&s, 0, 1);
    let block = payload(k[0]);
    let expected = StoreError::NamespaceMismatch { found: other, expected: s.namespace_hash() };
    assert_eq!(s.put(other, &k, &[&block]), Err(expected.clone()));
    assert_eq!(s.lookup(other, &k), Err(expected.clone()));
    assert_eq!(s.lease(other, &k), Err(expected.clone()));
    let message = expected.to_string();
    assert!(message.contains(&format!("{other:#034x}")) && message.contains("expected"), "{message}");
    assert_eq!(s.stats().objects, 0);
}

#[test]
fn keys_of_another_model_or_tenant_never_hit() {
    let s = store(16);
    let tokens: Vec<u32> = (0..64).collect();
    let mine = block_keys(s.namespace_hash(), &tokens, 16, &[]).unwrap();
    put_keys(&s, &mine);
    assert_eq!(s.lookup(s.namespace_hash(), &mine).unwrap().hit_blocks, 4);
    for other in [namespace("other-model", ""), namespace("test-model", "tenant-b")] {
        let theirs = block_keys(other.hash().unwrap(), &tokens, 16, &[]).unwrap();
        assert_eq!(s.lookup(s.namespace_hash(), &theirs).unwrap().hit_blocks, 0, "{other:?}");
    }
}
