//! An O(1) doubly linked list of block keys over a slab, with a key → node map: the queue that
//! LRU and S3-FIFO are built from. Head is the newest end, tail the oldest.

use kvtier_core::BlockKey;

use crate::hash::{key_map, KeyMap};

/// Index of a node in the slab.
pub(crate) type NodeId = u32;
const NIL: NodeId = NodeId::MAX;

#[derive(Debug)]
struct Node<T> {
    key: BlockKey,
    prev: NodeId,
    next: NodeId,
    data: T,
}

#[derive(Debug)]
pub(crate) struct KeyList<T> {
    nodes: Vec<Node<T>>,
    free: Vec<NodeId>,
    index: KeyMap<NodeId>,
    head: NodeId,
    tail: NodeId,
}

impl<T> KeyList<T> {
    pub(crate) fn new() -> Self {
        KeyList { nodes: Vec::new(), free: Vec::new(), index: key_map(), head: NIL, tail: NIL }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn contains(&self, key: BlockKey) -> bool {
        self.index.contains_key(&key)
    }

    pub(crate) fn data_mut(&mut self, key: BlockKey) -> Option<&mut T> {
        let id = *self.index.get(&key)?;
        Some(&mut self.nodes[id as usize].data)
    }

    /// Inserts `key` at the head. Panics if it is already present (a policy bug).
    pub(crate) fn push_front(&mut self, key: BlockKey, data: T) {
        let node = Node { key, prev: NIL, next: self.head, data };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                let id = NodeId::try_from(self.nodes.len()).expect("more than u32::MAX queued keys");
                assert_ne!(id, NIL, "more than u32::MAX - 1 queued keys");
                self.nodes.push(node);
                id
            }
        };
        assert!(self.index.insert(key, id).is_none(), "key {key:#x} queued twice");
        if self.head != NIL {
            self.nodes[self.head as usize].prev = id;
        }
        self.head = id;
        if self.tail == NIL {
            self.tail = id;
        }
    }

    fn unlink(&mut self, id: NodeId) {
        let (prev, next) = {
            let n = &self.nodes[id as usize];
            (n.prev, n.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// Removes `key`, returning its data.
    pub(crate) fn remove(&mut self, key: BlockKey) -> Option<T>
    where
        T: Default,
    {
        let id = self.index.remove(&key)?;
        self.unlink(id);
        self.free.push(id);
        Some(std::mem::take(&mut self.nodes[id as usize].data))
    }

    /// Moves `key` to the head; false if absent.
    pub(crate) fn move_to_front(&mut self, key: BlockKey) -> bool {
        let Some(&id) = self.index.get(&key) else { return false };
        if self.head != id {
            self.unlink(id);
            let node = &mut self.nodes[id as usize];
            node.prev = NIL;
            node.next = self.head;
            self.nodes[self.head as usize].prev = id;
            self.head = id;
        }
        true
    }

    /// The oldest node.
    pub(crate) fn tail(&self) -> Option<NodeId> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The node after `id` toward the head.
    pub(crate) fn newer(&self, id: NodeId) -> Option<NodeId> {
        let prev = self.nodes[id as usize].prev;
        (prev != NIL).then_some(prev)
    }

    pub(crate) fn key(&self, id: NodeId) -> BlockKey {
        self.nodes[id as usize].key
    }

    pub(crate) fn data(&self, id: NodeId) -> &T {
        &self.nodes[id as usize].data
    }

    /// Keys from oldest to newest.
    pub(crate) fn keys_oldest_first(&self) -> impl Iterator<Item = BlockKey> + '_ {
        std::iter::successors(self.tail(), |&id| self.newer(id)).map(|id| self.key(id))
    }

    /// Checks links, the map and the length agree.
    pub(crate) fn check_integrity(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cursor = self.head;
        while cursor != NIL {
            let node = &self.nodes[cursor as usize];
            if node.prev != prev {
                return Err(format!("queue node {cursor} has a broken back link"));
            }
            if self.index.get(&node.key) != Some(&cursor) {
                return Err(format!("queued key {:#x} is missing from the queue map", node.key));
            }
            count += 1;
            if count > self.index.len() {
                return Err("queue has a cycle or more nodes than its map".into());
            }
            prev = cursor;
            cursor = node.next;
        }
        if prev != self.tail || count != self.index.len() {
            return Err(format!("queue walk found {count} nodes; map has {}", self.index.len()));
        }
        Ok(())
    }
}
