//! Redis Cluster routing: hash slots (CRC16/XMODEM of the key mod 16384; kvtier keys carry no
//! `{hash tag}`, so blocks spread over all masters) and the slot → master map from
//! `CLUSTER SLOTS`, refreshed after a redirect or a failed node (rate-limited).

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::Endpoint;
use crate::node::Node;
use crate::resp::Reply;

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
}
