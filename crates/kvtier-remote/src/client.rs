//! [`RemoteClient`]: batched, pipelined EXISTS/GET/SET/DEL over one server or a Redis Cluster.
//!
//! A batch is split by server node (one group in single-server mode); groups run in parallel,
//! each as one pipeline on one pooled connection. An item whose node is down, or whose
//! connection fails mid-batch, gets [`Res::Failed`]; in cluster mode, an item sent elsewhere by
//! `ASK` (its slot migrating) is asked once of that master, and `MOVED` items are retried once
//! after the slot map is refreshed ([`crate::cluster`]). Nothing here raises while serving: results
//! are per item, and the caller turns failures into counted misses. (Deleting every key of a
//! pattern, an administrative operation that does return errors, is in [`crate::clear`].)

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::cluster::{Asks, Cluster, NO_NODE};
use crate::config::{RemoteConfig, Resolved};
use crate::error::RemoteError;
use crate::metrics::{bump, Counters, OpCounters, RemoteMetrics};
use crate::node::{not_ready, ConnectSettings, Node};
use crate::pipeline::{self, GetItem, Res, SetItem};
use crate::resp::{Conn, Reply};

pub(crate) enum Topology {
    Single(Arc<Node>),
    Cluster(Cluster),
}

/// Which operation a batch is (for metrics).
#[derive(Clone, Copy)]
enum Op {
    Exists,
    Get,
    Set,
    Del,
}

/// A client of one Redis/Valkey server or cluster; `Send + Sync`.
pub struct RemoteClient {
    config: RemoteConfig,
    resolved: Resolved,
    settings: ConnectSettings,
    counters: Counters,
    pub(crate) topology: Topology,
    /// The server answered a multi-key `EXISTS` with an error (e.g. a proxy that refuses
    /// multi-key commands): [`exists_all`](Self::exists_all) is not tried again.
    multi_exists_refused: AtomicBool,
}

impl std::fmt::Debug for RemoteClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteClient")
            .field("seeds", &self.resolved.seeds)
            .field("cluster", &self.config.cluster)
            .finish()
    }
}

/// One node's share of a batch: the node (`None`: no node serves it), item indices, names, items.
type Group<'n, T> = (Option<Arc<Node>>, Vec<usize>, Vec<&'n [u8]>, Vec<T>);

type RunFn<'f, T> = dyn Fn(&mut Conn, &[&[u8]], &mut [T], &mut [Res]) -> io::Result<()> + Sync + 'f;

impl RemoteClient {
    /// Validates the config and connects once: a bad setting or refused credentials is an
    /// error here; an unreachable server is not (it starts in backoff and its keys miss).
    pub fn open(config: RemoteConfig) -> Result<RemoteClient, RemoteError> {
        let resolved = config.resolve()?;
        let tls = crate::tls::client(resolved.tls.as_ref())?;
        let settings = ConnectSettings::new(&config, resolved.credentials.clone(), resolved.db, tls);
        let topology = if config.cluster {
            Topology::Cluster(Cluster::new(resolved.seeds.clone()))
        } else {
            Topology::Single(Arc::new(Node::new(resolved.seeds[0].clone())))
        };
        let client = RemoteClient {
            config,
            resolved,
            settings,
            counters: Counters::default(),
            topology,
            multi_exists_refused: AtomicBool::new(false),
        };
        match &client.topology {
            Topology::Single(node) => match node.checkout(&client.settings, &client.counters) {
                Ok(conn) => node.checkin(conn),
                Err(
                    e @ (RemoteError::Auth { .. } | RemoteError::Tls { .. } | RemoteError::Protocol { .. }),
                ) => return Err(e),
                Err(_) => {} // down at start: a miss now, a hit once it is up
            },
            Topology::Cluster(_) => {
                let refreshed = client.refresh_slots(true);
                if let Err(
                    e @ (RemoteError::Auth { .. } | RemoteError::Tls { .. } | RemoteError::Protocol { .. }),
                ) = refreshed
                {
                    return Err(e);
                }
            }
        }
        Ok(client)
    }

    pub fn config(&self) -> &RemoteConfig {
        &self.config
    }

    /// Groups item indices by the node serving them; items with no known node are `None`.
    fn route(&self, names: &[&[u8]]) -> Vec<(Option<Arc<Node>>, Vec<usize>)> {
        match &self.topology {
            Topology::Single(node) => vec![(Some(node.clone()), (0..names.len()).collect())],
            Topology::Cluster(cluster) => {
                let map = cluster.map.read().clone();
                let mut groups: Vec<(Option<Arc<Node>>, Vec<usize>)> =
                    map.nodes.iter().map(|n| (Some(n.clone()), Vec::new())).collect();
                let mut unrouted = Vec::new();
                for (i, name) in names.iter().enumerate() {
                    match map.node_for(name) {
                        Some((n, _)) => groups[n].1.push(i),
                        None => unrouted.push(i),
                    }
                }
                groups.retain(|g| !g.1.is_empty());
                if !unrouted.is_empty() {
                    groups.push((None, unrouted));
                }
                groups
            }
        }
    }

    fn op_counters(&self, op: Op) -> &OpCounters {
        match op {
            Op::Exists => &self.counters.exists,
            Op::Get => &self.counters.get,
            Op::Set => &self.counters.set,
            Op::Del => &self.counters.del,
        }
    }

    /// Runs one group's pipeline on one connection of its node; returns each item's result and
    /// the `ASK` redirections met (item index in the group, `host:port`).
    fn run_group<T>(
        &self,
        op: Op,
        node: &Node,
        names: &[&[u8]],
        items: &mut [T],
        run: &RunFn<'_, T>,
        bytes: u64,
    ) -> (Vec<Res>, Asks) {
        let mut out = vec![Res::Failed; names.len()];
        let start = Instant::now();
        let ran = node.run(&self.settings, &self.counters, |conn| {
            conn.asks.clear();
            run(conn, names, items, &mut out)?;
            Ok(std::mem::take(&mut conn.asks))
        });
        let asks = match ran {
            Ok(Ok(asks)) => asks,
            Ok(Err(_)) => Vec::new(), // failed mid-batch: its redirected items are misses
            Err(_) => return (out, Vec::new()), // no connection (down, in backoff, all busy)
        };
        let c = self.op_counters(op);
        c.record(names.len(), bytes, start.elapsed());
        let errors = out
            .iter()
            .filter(|r| matches!(r, Res::ServerError | Res::WrongType | Res::Redirect | Res::Failed))
            .count();
        bump(&c.errors, errors);
        (out, asks)
    }

    /// Runs `groups` (a node, `None` for no node, and the indices of its items), one pipeline
    /// each, in parallel when several: fills `out` for their items, takes their items from
    /// `slots` and puts them back, and returns the `ASK` redirections met (item index, `host:port`).
    #[allow(clippy::too_many_arguments)]
    fn run_groups<T: Send>(
        &self,
        op: Op,
        names: &[&[u8]],
        slots: &mut [Option<T>],
        groups: Vec<(Option<Arc<Node>>, Vec<usize>)>,
        out: &mut [Res],
        bytes_of: &(dyn Fn(&T) -> u64 + Sync),
        run: &RunFn<'_, T>,
    ) -> Asks {
        let mut work: Vec<Group<'_, T>> = groups
            .into_iter()
            .map(|(node, idx)| {
                let gnames = idx.iter().map(|&i| names[i]).collect();
                let gitems = idx.iter().map(|&i| slots[i].take().expect("each item in one group")).collect();
                (node, idx, gnames, gitems)
            })
            .collect();
        let run_one = |node: &Option<Arc<Node>>, gnames: &[&[u8]], gitems: &mut [T]| {
            let bytes = gitems.iter().map(bytes_of).sum();
            match node {
                Some(node) => self.run_group(op, node, gnames, gitems, run, bytes),
                None => (vec![Res::Failed; gnames.len()], Vec::new()),
            }
        };
        let results: Vec<(Vec<Res>, Asks)> = if work.len() == 1 {
            let (node, _, gnames, gitems) = &mut work[0];
            vec![run_one(node, gnames, gitems)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = work
                    .iter_mut()
                    .map(|(node, _, gnames, gitems)| s.spawn(|| run_one(node, gnames, gitems)))
                    .collect();
                handles.into_iter().map(|h| h.join().expect("a pipeline thread panicked")).collect()
            })
        };
        let mut asks = Vec::new();
        for ((_, idx, _, gitems), (res, group_asks)) in work.into_iter().zip(results) {
            asks.extend(group_asks.into_iter().map(|(j, target)| (idx[j], target)));
            for ((i, item), r) in idx.into_iter().zip(gitems).zip(res) {
                out[i] = r;
                slots[i] = Some(item);
            }
        }
        asks
    }

    /// Splits a batch by node and runs the groups (in parallel when several). In cluster mode,
    /// items whose slot is migrating (`ASK`) are asked once of the master the reply names, after
    /// `ASKING`; items still redirected (`MOVED`) or unrouted are retried once after the slot
    /// map is refreshed.
    fn execute<T: Send>(
        &self,
        op: Op,
        names: &[&[u8]],
        items: Vec<T>,
        bytes_of: &(dyn Fn(&T) -> u64 + Sync),
        run: &RunFn<'_, T>,
        retry: bool,
    ) -> (Vec<Res>, Vec<T>) {
        let n = names.len();
        let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
        let mut out = vec![Res::Failed; n];
        let asks = self.run_groups(op, names, &mut slots, self.route(names), &mut out, bytes_of, run);
        if let Topology::Cluster(cluster) = &self.topology {
            bump(&self.counters.redirects, out.iter().filter(|&&r| r == Res::Redirect).count());
            if retry && !asks.is_empty() {
                let asking = |c: &mut Conn, n: &[&[u8]], items: &mut [T], out: &mut [Res]| {
                    c.asking = true;
                    let ran = run(c, n, items, out);
                    c.asking = false;
                    ran
                };
                let groups = cluster.ask_groups(asks);
                self.run_groups(op, names, &mut slots, groups, &mut out, bytes_of, &asking);
            }
            let redirected: Vec<usize> = (0..n).filter(|&i| out[i] == Res::Redirect).collect();
            if !redirected.is_empty() || out.contains(&Res::Failed) {
                let _ = self.refresh_slots(!redirected.is_empty());
            }
            if retry && !redirected.is_empty() {
                let rnames: Vec<&[u8]> = redirected.iter().map(|&i| names[i]).collect();
                let ritems: Vec<T> = redirected.iter().map(|&i| slots[i].take().expect("once")).collect();
                let (rres, ritems) = self.execute(op, &rnames, ritems, bytes_of, run, false);
                for ((&i, r), item) in redirected.iter().zip(rres).zip(ritems) {
                    out[i] = r;
                    slots[i] = Some(item);
                }
            }
        }
        (out, slots.into_iter().map(|s| s.expect("every item came back")).collect())
    }

    /// `EXISTS` per name.
    pub fn exists(&self, names: &[&[u8]]) -> Vec<Res> {
        let run = |c: &mut Conn, n: &[&[u8]], _: &mut [()], out: &mut [Res]| pipeline::exists(c, n, out);
        self.execute(Op::Exists, names, vec![(); names.len()], &|_| 0, &run, true).0
    }

    /// Whether every name exists, in one multi-key `EXISTS` (the server counts them: one command
    /// instead of one per name). `Some(true)`: all exist (a name listed twice counts twice, so the
    /// count still says so); `Some(false)`: at least one does not; `None`: unknown (server down or
    /// failing), or a cluster, where the names of one command must share a slot (`CROSSSLOT`) —
    /// ask per name with [`exists`](Self::exists) then. A server that answers it with an error
    /// (other than busy or loading) is not asked this way again. The `exists` metrics count the command's names as keys.
    pub fn exists_all(&self, names: &[&[u8]]) -> Option<bool> {
        if names.is_empty() {
            return Some(true);
        }
        if matches!(self.topology, Topology::Cluster(_)) || self.multi_exists_refused.load(Ordering::Relaxed)
        {
            return None;
        }
        let run = |c: &mut Conn, n: &[&[u8]], _: &mut [()], out: &mut [Res]| {
            let mut args: Vec<&[u8]> = Vec::with_capacity(n.len() + 1);
            args.push(b"EXISTS");
            args.extend_from_slice(n);
            c.write_command(&args)?;
            c.flush()?;
            let all = match c.read_reply()? {
                Reply::Int(count) => Res::Bool(count >= 0 && count as usize == n.len()),
                // Busy or loading is not a refusal of multi-key EXISTS: unknown this once.
                Reply::Error(e) if not_ready(&e) => Res::Failed,
                Reply::Error(_) => Res::ServerError,
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("expected an integer, got {other:?}"),
                    ))
                }
            };
            out.iter_mut().for_each(|o| *o = all);
            Ok(())
        };
        let res = self.execute(Op::Exists, names, vec![(); names.len()], &|_| 0, &run, false).0;
        match res[0] {
            Res::Bool(all) if res.iter().all(|r| *r == res[0]) => Some(all),
            Res::ServerError => {
                self.multi_exists_refused.store(true, Ordering::Relaxed);
                None
            }
            _ => None,
        }
    }

    /// `DEL` per name.
    pub fn del(&self, names: &[&[u8]]) -> Vec<Res> {
        let run = |c: &mut Conn, n: &[&[u8]], _: &mut [()], out: &mut [Res]| pipeline::del(c, n, out);
        self.execute(Op::Del, names, vec![(); names.len()], &|_| 0, &run, true).0
    }

    /// `GET` per name into its item's buffers (no intermediate copy).
    pub fn get<'a>(&self, names: &[&[u8]], items: Vec<GetItem<'a>>) -> (Vec<Res>, Vec<GetItem<'a>>) {
        let window = self.config.inflight_bytes_max;
        let run = move |c: &mut Conn, n: &[&[u8]], items: &mut [GetItem<'a>], out: &mut [Res]| {
            pipeline::get(c, n, items, window, out)
        };
        let bytes = |g: &GetItem<'a>| (g.dst.len() + if g.with_header { g.header.len() } else { 0 }) as u64;
        self.execute(Op::Get, names, items, &bytes, &run, true)
    }

    /// `SET name value [NX] [EX ttl]` per name (see [`SetItem`] for what a value is).
    pub fn set(&self, names: &[&[u8]], items: &[SetItem<'_>], nx: bool) -> Vec<Res> {
        let window = self.config.inflight_bytes_max;
        let ttl = self.config.ttl.map(|t| t.as_secs().max(1));
        let run = move |c: &mut Conn, n: &[&[u8]], v: &mut [SetItem<'_>], out: &mut [Res]| {
            pipeline::set(c, n, v, nx, ttl, window, out)
        };
        self.execute(Op::Set, names, items.to_vec(), &SetItem::value_len, &run, true).0
    }

    /// `GET` per name, each whole value read into memory (codec objects of unknown size, tests,
    /// tools), pipelined: values of at most `value_bytes_max` bytes, each counting that much in
    /// the in-flight window (`inflight_bytes_max`); a longer value is read and dropped
    /// ([`Res::WrongLength`]). 0 (size unknown) reads values up to
    /// [`REPLY_BULK_BYTES_MAX`](crate::resp::REPLY_BULK_BYTES_MAX) and bounds the window by
    /// command count instead, as `EXISTS` and `DEL` are. `None`: no such key, a value too long,
    /// or the server failed (counted). The `get` metrics do not count these values' bytes.
    pub fn get_values(&self, names: &[&[u8]], value_bytes_max: u64) -> Vec<Option<Vec<u8>>> {
        self.get_values_res(names, value_bytes_max).into_iter().map(Result::ok).collect()
    }

    /// As [`get_values`](Self::get_values), with what each missing value got instead
    /// ([`Res::Nil`], [`Res::WrongType`], [`Res::Failed`], ...).
    pub fn get_values_res(&self, names: &[&[u8]], value_bytes_max: u64) -> Vec<Result<Vec<u8>, Res>> {
        let window = self.config.inflight_bytes_max;
        let run = move |c: &mut Conn, n: &[&[u8]], v: &mut [Option<Vec<u8>>], out: &mut [Res]| {
            pipeline::get_whole(c, n, v, value_bytes_max, window, out)
        };
        let (res, values) = self.execute(Op::Get, names, vec![None; names.len()], &|_| 0, &run, true);
        values
            .into_iter()
            .zip(res)
            .map(|(v, r)| match (r, v) {
                (Res::Filled, Some(v)) => Ok(v),
                (r, _) => Err(r),
            })
            .collect()
    }

    /// Refreshes a cluster's slot map ([`Cluster::refresh`]); nothing for one server.
    pub(crate) fn refresh_slots(&self, force: bool) -> Result<(), RemoteError> {
        match &self.topology {
            Topology::Cluster(cluster) => cluster.refresh(&self.settings, &self.counters, force),
            Topology::Single(_) => Ok(()),
        }
    }

    /// Every node that holds keys (the server; in a cluster each master, after a slot-map
    /// refresh) and how many hash slots no known master serves.
    pub(crate) fn masters(&self) -> Result<(Vec<Arc<Node>>, usize), RemoteError> {
        match &self.topology {
            Topology::Single(node) => Ok((vec![node.clone()], 0)),
            Topology::Cluster(cluster) => {
                self.refresh_slots(true)?;
                let map = cluster.map.read().clone();
                let uncovered = map.slot_node.iter().filter(|&&n| n == NO_NODE).count();
                Ok((map.nodes.clone(), uncovered))
            }
        }
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    pub(crate) fn settings(&self) -> &ConnectSettings {
        &self.settings
    }

    /// Every node known and how many are in reconnect backoff.
    fn node_counts(&self) -> (u64, u64) {
        match &self.topology {
            Topology::Single(n) => (1, u64::from(n.is_down())),
            Topology::Cluster(c) => {
                let map = c.map.read();
                (map.nodes.len() as u64, map.nodes.iter().filter(|n| n.is_down()).count() as u64)
            }
        }
    }

    pub fn metrics(&self) -> RemoteMetrics {
        let (nodes, down) = self.node_counts();
        self.counters.snapshot(nodes, down)
    }
}
