//! A Redis Cluster moving a hash slot between masters (`CLUSTER SETSLOT .. MIGRATING/IMPORTING`,
//! `MIGRATE`, then `SETSLOT .. NODE`), against real loopback servers: a block moved mid-migration
//! is read from its new master (`-ASK`), a block written meanwhile lands there, and once the
//! slot has moved (`-MOVED`) the slot map follows — never wrong bytes, never a block lost.

use std::time::Duration;

use kvtier_core::tier::{ReadOutcome, Tier};
use kvtier_remote::cluster::{slot, SLOTS};
use kvtier_remote::resp::Reply;
use kvtier_remote::testing::{require_server_binary, LoopbackCluster, LoopbackServer};
use kvtier_remote::{key_name, RemoteConfig, RemoteTier};

const NS: u128 = 0x5107;
const BLOCK_BYTES: usize = 512;

fn payload(key: u128) -> Vec<u8> {
    (0..BLOCK_BYTES).map(|j| (j as u8).wrapping_mul(13) ^ key as u8).collect()
}

fn read(tier: &RemoteTier, key: u128) -> ReadOutcome {
    let mut buf = vec![0u8; BLOCK_BYTES];
    let outcome = tier.read_blocks(NS, &[key], &mut [&mut buf[..]])[0];
    if outcome == ReadOutcome::Loaded {
        assert_eq!(buf, payload(key), "block {key}: the bytes of another block");
    }
    outcome
}

fn ok(node: &LoopbackServer, args: &[&[u8]]) {
    assert_eq!(
        node.command(args),
        Reply::Status("OK".into()),
        "{:?}",
        String::from_utf8_lossy(&args.concat())
    );
}

fn node_id(node: &LoopbackServer) -> Vec<u8> {
    match node.command(&[b"CLUSTER", b"MYID"]) {
        Reply::Bulk(Some(id)) => id,
        other => panic!("CLUSTER MYID answered {other:?}"),
    }
}

#[test]
fn a_slot_moving_between_masters_is_followed() {
    let binary = require_server_binary();
    let cluster = LoopbackCluster::start(&binary, 3);
    let config = RemoteConfig {
        urls: cluster.urls(),
        cluster: true,
        reconnect_backoff_min: Duration::from_millis(5),
        reconnect_backoff_max: Duration::from_millis(20),
        ..RemoteConfig::default()
    };
    let tier = RemoteTier::open(config, NS).unwrap();
    let name = |k: u128| key_name("kvtier:", NS, k);
    // Block 1 moves from its master to the next one; block `fresh` (same slot) is written mid-move.
    let moving = slot(&name(1));
    let fresh = (2..).find(|&k| slot(&name(k)) == moving).unwrap();
    let from = moving as usize / SLOTS.div_ceil(3);
    let (source, target) = (&cluster.nodes[from], &cluster.nodes[(from + 1) % 3]);
    assert_eq!(tier.put(NS, &[1], &[&payload(1)]).stored, 1);
    let s = moving.to_string();
    let (source_id, target_id) = (node_id(source), node_id(target));
    ok(target, &[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"IMPORTING", &source_id]);
    ok(source, &[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"MIGRATING", &target_id]);
    let port = target.port.to_string();
    ok(source, &[b"MIGRATE", b"127.0.0.1", port.as_bytes(), b"", b"0", b"5000", b"KEYS", &name(1)]);

    assert_eq!(read(&tier, 1), ReadOutcome::Loaded, "moved mid-migration: ASK names its new master");
    assert_eq!(tier.put(NS, &[fresh], &[&payload(fresh)]).stored, 1, "written mid-migration");
    assert_eq!(read(&tier, fresh), ReadOutcome::Loaded);

    for node in &cluster.nodes {
        ok(node, &[b"CLUSTER", b"SETSLOT", s.as_bytes(), b"NODE", &target_id]);
    }
    assert_eq!(read(&tier, 1), ReadOutcome::Loaded, "after the move: MOVED, the slot map refreshed");
    assert_eq!(read(&tier, fresh), ReadOutcome::Loaded);
    assert!(tier.metrics().redirects >= 1);
}
