//! Redis Cluster routing: hash slots (CRC16/XMODEM of the key mod 16384; kvtier keys carry no
//! `{hash tag}`, so blocks spread over all masters) and the slot → master map from
//! `CLUSTER SLOTS`, refreshed after a redirect or a failed node (rate-limited); and where an
//! `ASK` reply sends an item (`Cluster::ask_groups`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::config::Endpoint;
use crate::error::RemoteError;
use crate::metrics::{bump, Counters};
use crate::node::{ConnectSettings, Node};
use crate::resp::Reply;

/// `ASK` redirections of a batch: (item index, `host:port` of the master to ask).
pub(crate) type Asks = Vec<(usize, String)>;

/// Shortest time between two slot-map refreshes.
const SLOT_REFRESH_INTERVAL_MIN: Duration = Duration::from_millis(100);

pub const SLOTS: usize = 16384;
/// Slot with no known master.
pub const NO_NODE: u16 = u16::MAX;

/// CRC16/XMODEM (polynomial 0x1021, init 0), as Redis Cluster uses.
pub fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// The hash slot of a key (honouring a non-empty `{tag}` as Redis does).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS as u16
}

/// Which master serves each slot.
#[derive(Debug)]
pub(crate) struct SlotMap {
    pub nodes: Vec<Arc<Node>>,
    pub slot_node: Vec<u16>,
}

impl SlotMap {
    pub fn empty() -> Self {
        SlotMap { nodes: Vec::new(), slot_node: vec![NO_NODE; SLOTS] }
    }

    pub fn node_for(&self, key: &[u8]) -> Option<(usize, &Arc<Node>)> {
        let n = self.slot_node[slot(key) as usize];
        (n != NO_NODE).then(|| (n as usize, &self.nodes[n as usize]))
    }

    /// Builds a map from a `CLUSTER SLOTS` reply; `asked` fills in masters reported without a
    /// host; `known` reuses nodes (and their connection pools) across refreshes.
    pub fn from_reply(
        reply: &Reply,
        asked: &Endpoint,
        known: &mut HashMap<Endpoint, Arc<Node>>,
    ) -> Result<SlotMap, String> {
        let Reply::Array(Some(ranges)) = reply else {
            return Err(format!("CLUSTER SLOTS answered {reply:?}"));
        };
        let mut map = SlotMap::empty();
        let mut index: HashMap<Endpoint, u16> = HashMap::new();
        for range in ranges {
            let Reply::Array(Some(fields)) = range else { return Err("a slot range is not an array".into()) };
            let (Some(Reply::Int(start)), Some(Reply::Int(end)), Some(Reply::Array(Some(master)))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err("a slot range lacks start, end or master".into());
            };
            if !(0..SLOTS as i64).contains(start) || !(*start..SLOTS as i64).contains(end) {
                return Err(format!("slot range {start}..={end} is outside 0..{SLOTS}"));
            }
            let host = match master.first() {
                Some(Reply::Bulk(Some(h))) if !h.is_empty() && h != b"?" => {
                    String::from_utf8_lossy(h).into_owned()
                }
                _ => asked.host.clone(),
            };
            let Some(Reply::Int(port)) = master.get(1) else { return Err("a master has no port".into()) };
            let Ok(port) = u16::try_from(*port) else {
                return Err(format!("master port {port} is out of range"));
            };
            let endpoint = Endpoint { host, port };
            let n = match index.get(&endpoint) {
                Some(&n) => n,
                None => {
                    // Each master serves a slot, so a map has at most SLOTS of them (and their
                    // indices stay below NO_NODE); more is a broken reply, not a cluster.
                    if map.nodes.len() >= SLOTS {
                        return Err(format!("CLUSTER SLOTS names more than {SLOTS} masters"));
                    }
                    let node = known
                        .entry(endpoint.clone())
                        .or_insert_with(|| Arc::new(Node::new(endpoint.clone())));
                    map.nodes.push(node.clone());
                    let n = (map.nodes.len() - 1) as u16;
                    index.insert(endpoint, n);
                    n
                }
            };
            for s in *start..=*end {
                map.slot_node[s as usize] = n;
            }
        }
        Ok(map)
    }
}

/// A client's view of a cluster: its seeds, every node met (with its connection pool), and the
/// slot map.
pub(crate) struct Cluster {
    seeds: Vec<Endpoint>,
    known: Mutex<HashMap<Endpoint, Arc<Node>>>,
    pub map: RwLock<Arc<SlotMap>>,
    refreshes: Mutex<Refreshes>,
}

/// Which refreshes began and which one's map is in use: refreshes run concurrently (a forced
/// one never waits for or skips another), and a map is installed only if no refresh that began
/// after its own installed one already, so a slow refresh cannot bring back the older map of a
/// server it asked first (say, one that predates a master a clear must reach).
#[derive(Default)]
struct Refreshes {
    last_started: Option<Instant>,
    started: u64,
    installed: u64,
}

impl Cluster {
    pub fn new(seeds: Vec<Endpoint>) -> Self {
        Cluster {
            seeds,
            known: Mutex::new(HashMap::new()),
            map: RwLock::new(Arc::new(SlotMap::empty())),
            refreshes: Mutex::new(Refreshes::default()),
        }
    }

    /// The items of `asks` grouped by the master each `ASK` named (`host:port`; a master not
    /// met yet, such as a new one a slot is moving to, is added); items whose `host:port` does
    /// not parse as an endpoint are in a group with no node (misses).
    pub fn ask_groups(&self, asks: Asks) -> Vec<(Option<Arc<Node>>, Vec<usize>)> {
        let mut groups: Vec<(Option<Arc<Node>>, Vec<usize>)> = Vec::new();
        let mut known = self.known.lock();
        for (i, target) in asks {
            let node = ask_endpoint(&target)
                .map(|e| known.entry(e.clone()).or_insert_with(|| Arc::new(Node::new(e))).clone());
            let same = |g: &(Option<Arc<Node>>, Vec<usize>)| match (&g.0, &node) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            match groups.iter_mut().find(|g| same(g)) {
                Some(group) => group.1.push(i),
                None => groups.push((node, vec![i])),
            }
        }
        groups
    }
}

/// The endpoint of an `ASK` reply's `host:port` (an IPv6 address unbracketed, as Redis writes
/// it); `None` for an empty or invalid host, or a bad port.
fn ask_endpoint(target: &str) -> Option<Endpoint> {
    let (host, port) = target.rsplit_once(':')?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let port = port.parse::<u16>().ok().filter(|&p| p > 0)?;
    crate::url::valid_host(host).then(|| Endpoint { host: host.to_string(), port })
}

impl Cluster {
    /// Asks the known nodes, then the seeds, for the slot map (at most once per
    /// [`SLOT_REFRESH_INTERVAL_MIN`] unless `force`; a forced refresh always asks). `Err` only
    /// if none answered. The map it gets is installed unless a refresh that began later
    /// installed one first ([`Refreshes`]).
    pub(crate) fn refresh(
        &self,
        settings: &ConnectSettings,
        counters: &Counters,
        force: bool,
    ) -> Result<(), RemoteError> {
        let seq = {
            let mut refreshes = self.refreshes.lock();
            if !force && refreshes.last_started.is_some_and(|t| t.elapsed() < SLOT_REFRESH_INTERVAL_MIN) {
                return Ok(());
            }
            refreshes.last_started = Some(Instant::now());
            refreshes.started += 1;
            refreshes.started
        };
        bump(&counters.slot_refreshes, 1);
        let mut candidates: Vec<Arc<Node>> = self.map.read().nodes.clone();
        {
            let mut known = self.known.lock();
            for seed in &self.seeds {
                let node = known.entry(seed.clone()).or_insert_with(|| Arc::new(Node::new(seed.clone())));
                if !candidates.iter().any(|c| c.endpoint == *seed) {
                    candidates.push(node.clone());
                }
            }
        }
        let mut last_error = None;
        for node in candidates {
            let reply = node.run(settings, counters, |conn| {
                conn.write_command(&[b"CLUSTER", b"SLOTS"])?;
                conn.flush()?;
                conn.read_reply()
            });
            let reply = match reply {
                Ok(reply) => reply,
                Err(e) => {
                    last_error = Some(e);
                    continue;
                }
            };
            match reply {
                Ok(reply @ Reply::Array(Some(_))) => {
                    let map = SlotMap::from_reply(&reply, &node.endpoint, &mut self.known.lock());
                    match map {
                        Ok(map) => {
                            self.install(seq, map);
                            return Ok(());
                        }
                        Err(reason) => {
                            last_error =
                                Some(RemoteError::Protocol { endpoint: node.endpoint.to_string(), reason })
                        }
                    }
                }
                Ok(other) => {
                    last_error = Some(RemoteError::Protocol {
                        endpoint: node.endpoint.to_string(),
                        reason: format!("CLUSTER SLOTS answered {other:?}; is this server in cluster mode?"),
                    });
                }
                Err(e) => {
                    last_error =
                        Some(RemoteError::Io { endpoint: node.endpoint.to_string(), reason: e.to_string() });
                }
            }
        }
        Err(last_error.unwrap_or(RemoteError::Config("no cluster seed nodes".into())))
    }

    /// Installs the map of the `seq`th refresh begun, unless a later one's is installed; returns
    /// whether it was.
    fn install(&self, seq: u64, map: SlotMap) -> bool {
        let mut refreshes = self.refreshes.lock();
        if seq <= refreshes.installed {
            return false;
        }
        refreshes.installed = seq;
        *self.map.write() = Arc::new(map);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification / `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
    }

    #[test]
    fn parses_ask_targets() {
        let e = |host: &str, port| Some(Endpoint { host: host.into(), port });
        assert_eq!(ask_endpoint("127.0.0.1:7001"), e("127.0.0.1", 7001));
        assert_eq!(ask_endpoint("::1:7001"), e("::1", 7001));
        assert_eq!(ask_endpoint("[::1]:7001"), e("::1", 7001));
        assert_eq!(ask_endpoint("node-2.example:7001"), e("node-2.example", 7001));
        for bad in [":7001", "h:0", "h:x", "h", "bad host:1", "?:1"] {
            assert_eq!(ask_endpoint(bad), None, "{bad}");
        }
    }

    #[test]
    fn parses_slots_reply() {
        let master = |port| Reply::Array(Some(vec![Reply::Bulk(Some(b"".to_vec())), Reply::Int(port)]));
        let reply = Reply::Array(Some(vec![
            Reply::Array(Some(vec![Reply::Int(0), Reply::Int(8191), master(7000)])),
            Reply::Array(Some(vec![Reply::Int(8192), Reply::Int(16383), master(7001)])),
        ]));
        let asked = Endpoint { host: "127.0.0.1".into(), port: 7000 };
        let mut known = HashMap::new();
        let map = SlotMap::from_reply(&reply, &asked, &mut known).unwrap();
        assert_eq!(map.nodes.len(), 2);
        assert_eq!(map.slot_node[0], 0);
        assert_eq!(map.slot_node[16383], 1);
        assert_eq!(map.nodes[1].endpoint.port, 7001);
        let bad =
            Reply::Array(Some(vec![Reply::Array(Some(vec![Reply::Int(5), Reply::Int(20000), master(1)]))]));
        assert!(SlotMap::from_reply(&bad, &asked, &mut known).is_err());
    }

    #[test]
    fn a_slow_refresh_never_replaces_the_map_of_one_that_began_after_it() {
        let cluster = Cluster::new(vec![]);
        let map_of = |port: i64| {
            let master = Reply::Array(Some(vec![Reply::Bulk(Some(b"10.0.0.1".to_vec())), Reply::Int(port)]));
            let reply =
                Reply::Array(Some(vec![Reply::Array(Some(vec![Reply::Int(0), Reply::Int(16383), master]))]));
            let asked = Endpoint { host: "10.0.0.1".into(), port: 1 };
            SlotMap::from_reply(&reply, &asked, &mut HashMap::new()).unwrap()
        };
        let port = |c: &Cluster| c.map.read().nodes[0].endpoint.port;
        // Refreshes 1 and 2 began in that order; 2 answered first.
        assert!(cluster.install(2, map_of(7002)));
        assert!(!cluster.install(1, map_of(7001)), "the older answer came last and was dropped");
        assert_eq!(port(&cluster), 7002);
        assert!(cluster.install(3, map_of(7003)));
        assert_eq!(port(&cluster), 7003);
    }

    #[test]
    fn a_reply_naming_more_masters_than_slots_is_refused() {
        let range = |port: i64| {
            let master = Reply::Array(Some(vec![Reply::Bulk(Some(b"10.0.0.1".to_vec())), Reply::Int(port)]));
            Reply::Array(Some(vec![Reply::Int(port % 16384), Reply::Int(port % 16384), master]))
        };
        let asked = Endpoint { host: "10.0.0.1".into(), port: 1 };
        let mut known = HashMap::new();
        let most = Reply::Array(Some((1..=SLOTS as i64).map(range).collect()));
        let map = SlotMap::from_reply(&most, &asked, &mut known).unwrap();
        assert_eq!(map.nodes.len(), SLOTS);
        assert!(map.slot_node.iter().all(|&n| usize::from(n) < SLOTS), "every slot names one of them");
        // One more is refused: unchecked, 65535 of them wrapped their u16 indices onto NO_NODE.
        let more = Reply::Array(Some((1..=SLOTS as i64 + 1).map(range).collect()));
        let err = SlotMap::from_reply(&more, &asked, &mut known).unwrap_err();
        assert_eq!(err, format!("CLUSTER SLOTS names more than {SLOTS} masters"));
    }
}
