//! [`RadixPrefixCache`]: SGLang's RadixAttention cache over paged blocks. A
//! radix tree over token ids (one tree per salt) whose nodes hold references
//! to the blocks under their tokens, so prefixes of any length hit,
//! including ones shorter than a block and ones that end inside a block.
//! Lookups lock the matched path; eviction removes unlocked leaves, least
//! recently used first.
//!
//! A node covering positions `start..start + key.len()` holds the blocks
//! of block indices `start / bs ..= (start + key.len() − 1) / bs`: a block
//! straddling a split is held by both sides, and every held block contains
//! the node's path tokens at their positions (checked by
//! [`PrefixCache::check_invariants`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{PagedCacheError, Result};
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool};
use crate::prefix::{PrefixCache, PrefixHit, PrefixLock};

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Node {
    parent: u32,
    key: Vec<u32>,
    start: usize,
    children: HashMap<u32, u32>,
    blocks: Vec<BlockId>,
    lock: u32,
    last_used: u64,
}

/// SGLang-style token radix tree over a block pool (see the module docs).
#[derive(Clone, Debug)]
pub struct RadixPrefixCache {
    block_size: usize,
    nodes: Vec<Option<Node>>,
    vacant: Vec<u32>,
    roots: HashMap<u64, u32>,
    clock: u64,
    held: usize,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixPrefixCache {
    /// An empty tree for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            nodes: Vec::new(),
            vacant: Vec::new(),
            roots: HashMap::new(),
            clock: 0,
            held: 0,
        }
    }

    /// Block references the tree holds (a block straddling a split counts twice).
    pub fn held_references(&self) -> usize {
        self.held
    }

    /// Live nodes, roots included.
    pub fn nodes(&self) -> usize {
        self.nodes.iter().flatten().count()
    }

    fn node(&self, i: u32) -> &Node {
        self.nodes[i as usize].as_ref().expect("live node")
    }

    fn node_mut(&mut self, i: u32) -> &mut Node {
        self.nodes[i as usize].as_mut().expect("live node")
    }

    fn add(&mut self, node: Node) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Block indices a node covering `len` tokens from `start` holds.
    fn block_range(&self, start: usize, len: usize) -> std::ops::RangeInclusive<usize> {
        if len == 0 {
            #[allow(clippy::reversed_empty_ranges)]
            return 1..=0;
        }
        start / self.block_size..=(start + len - 1) / self.block_size
    }

    /// Splits `child` after `m` of its tokens; returns the new upper node.
    fn split(&mut self, pool: &mut BlockPool, child: u32, m: usize) -> Result<u32> {
        let (parent, start, lock, last_used) = {
            let c = self.node(child);
            (c.parent, c.start, c.lock, c.last_used)
        };
        let first = start / self.block_size;
        let upper_range = self.block_range(start, m);
        let upper_blocks: Vec<BlockId> = self.node(child).blocks
            [upper_range.start() - first..=upper_range.end() - first]
            .to_vec();
        for &b in &upper_blocks {
            pool.acquire(b)?;
        }
        self.held += upper_blocks.len();
        let new_start = start + m;
        let drop = new_start / self.block_size - first;
        // The lower part keeps its id (locks taken through it stay valid);
        // the upper part starts with the same lock count, as every lock
        // through the lower part passes through it.
        let (head, dropped, split_token) = {
            let n = self.node_mut(child);
            let head: Vec<u32> = n.key.drain(..m).collect();
            n.start = new_start;
            (head, n.blocks.drain(..drop).collect::<Vec<_>>(), n.key[0])
        };
        let head_token = head[0];
        let upper = self.add(Node {
            parent,
            key: head,
            start,
            children: HashMap::from([(split_token, child)]),
            blocks: upper_blocks,
            lock,
            last_used,
        });
        self.node_mut(child).parent = upper;
        for b in dropped {
            pool.release(b)?;
        }
        self.held -= drop;
        self.node_mut(parent).children.insert(head_token, upper);
        Ok(upper)
    }
}

impl PrefixCache for RadixPrefixCache {
    fn name(&self) -> &'static str {
        "radix"
    }

    fn lookup(&mut self, pool: &mut BlockPool, tokens: &[u32], salt: u64) -> Result<PrefixHit> {
        let limit = tokens.len().saturating_sub(1);
        let Some(&root) = self.roots.get(&salt) else {
            return Ok(PrefixHit::default());
        };
        self.clock += 1;
        let mut path = Vec::new();
        let (mut node, mut pos) = (root, 0);
        while pos < limit {
            let Some(&child) = self.node(node).children.get(&tokens[pos]) else {
                break;
            };
            let key = &self.node(child).key;
            let m = common_prefix(key, &tokens[pos..limit]);
            let whole = m == key.len();
            // A partial match splits the node, so that the lock taken below
            // pins the matched tokens' blocks only: a lock on the whole node
            // would keep its unmatched tail from eviction while this
            // sequence lives, and a pool short of blocks could then admit
            // nothing (SGLang's match_prefix splits the same way).
            let child = if whole {
                child
            } else {
                self.split(pool, child, m)?
            };
            path.push((child, m));
            pos += m;
            if !whole {
                break;
            }
            node = child;
        }
        let Some(&(deepest, _)) = path.last() else {
            return Ok(PrefixHit::default());
        };
        let mut blocks = vec![BlockId(0); pos.div_ceil(self.block_size)];
        for &(n, m) in &path {
            let node = self.node(n);
            let first = node.start / self.block_size;
            for k in self.block_range(node.start, m) {
                blocks[k] = node.blocks[k - first];
            }
        }
        for &b in &blocks {
            pool.acquire(b)?;
        }
        let clock = self.clock;
        for &(n, _) in &path {
            let node = self.node_mut(n);
            node.lock += 1;
            node.last_used = clock;
        }
        Ok(PrefixHit {
            tokens: pos,
            blocks,
            lock: Some(PrefixLock(deepest)),
        })
    }

    fn insert(
        &mut self,
        pool: &mut BlockPool,
        tokens: &[u32],
        blocks: &[BlockId],
        salt: u64,
    ) -> Result<()> {
        let needed = tokens.len().div_ceil(self.block_size);
        if blocks.len() < needed {
            return Err(PagedCacheError::ShapeMismatch {
                what: "blocks of the inserted tokens",
                found: blocks.len(),
                expected: needed,
            });
        }
        if tokens.is_empty() {
            return Ok(());
        }
        self.clock += 1;
        let clock = self.clock;
        let root = match self.roots.get(&salt) {
            Some(&r) => r,
            None => {
                let r = self.add(Node {
                    parent: NIL,
                    key: Vec::new(),
                    start: 0,
                    children: HashMap::new(),
                    blocks: Vec::new(),
                    lock: 0,
                    last_used: clock,
                });
                self.roots.insert(salt, r);
                r
            }
        };
        let (mut node, mut pos) = (root, 0);
        while pos < tokens.len() {
            match self.node(node).children.get(&tokens[pos]).copied() {
                None => {
                    let range = self.block_range(pos, tokens.len() - pos);
                    let leaf_blocks = blocks[range].to_vec();
                    for &b in &leaf_blocks {
                        pool.acquire(b)?;
                    }
                    self.held += leaf_blocks.len();
                    let leaf = self.add(Node {
                        parent: node,
                        key: tokens[pos..].to_vec(),
                        start: pos,
                        children: HashMap::new(),
                        blocks: leaf_blocks,
                        lock: 0,
                        last_used: clock,
                    });
                    self.node_mut(node).children.insert(tokens[pos], leaf);
                    break;
                }
                Some(child) => {
                    let m = common_prefix(&self.node(child).key, &tokens[pos..]);
                    node = if m < self.node(child).key.len() {
                        self.split(pool, child, m)?
                    } else {
                        child
                    };
                    self.node_mut(node).last_used = clock;
                    pos += m;
                }
            }
        }
        Ok(())
    }

    fn release(&mut self, lock: PrefixLock) {
        let mut at = lock.0;
        while at != NIL {
            let node = self.node_mut(at);
            if node.parent == NIL {
                break;
            }
            node.lock -= 1;
            at = node.parent;
        }
    }

    fn forget(&mut self, _: BlockId, _: BlockHash) {}

    fn evict(&mut self, pool: &mut BlockPool, blocks: usize) -> Result<usize> {
        let evictable = |n: &Node| n.parent != NIL && n.lock == 0 && n.children.is_empty();
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                n.as_ref()
                    .filter(|n| evictable(n))
                    .map(|n| Reverse((n.last_used, i as u32)))
            })
            .collect();
        let mut freed = 0;
        while freed < blocks {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let node = self.nodes[i as usize].take().expect("leaf in heap is live");
            self.vacant.push(i);
            for &b in &node.blocks {
                freed += usize::from(pool.release(b)?);
            }
            self.held -= node.blocks.len();
            let parent = self.node_mut(node.parent);
            parent.children.remove(&node.key[0]);
            if evictable(parent) {
                let entry = Reverse((parent.last_used, node.parent));
                heap.push(entry);
            }
        }
        Ok(freed)
    }

    fn evictable_blocks(&self, pool: &BlockPool) -> usize {
        // Lock counts are path counts, so an unlocked node has no locked
        // descendant and all unlocked nodes can go, leaves first. A block is
        // freed when every reference to it is an unlocked node's.
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for node in self.nodes.iter().flatten() {
            if node.parent != NIL && node.lock == 0 {
                for &b in &node.blocks {
                    *refs.entry(b).or_default() += 1;
                }
            }
        }
        refs.into_iter()
            .filter(|&(b, n)| pool.ref_count(b).is_ok_and(|c| c == n))
            .count()
    }

    fn for_each_held(&self, f: &mut dyn FnMut(BlockId)) {
        for node in self.nodes.iter().flatten() {
            node.blocks.iter().copied().for_each(&mut *f);
        }
    }

    fn cached_blocks(&self) -> usize {
        let mut all: Vec<BlockId> = self
            .nodes
            .iter()
            .flatten()
            .flat_map(|n| n.blocks.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }

    fn check_invariants(&self, pool: &BlockPool) -> std::result::Result<(), String> {
        let bs = self.block_size;
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        let mut held = 0;
        for (i, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            let range = self.block_range(node.start, node.key.len());
            if node.blocks.len() != range.clone().count() {
                return Err(format!(
                    "node {i} holds {} blocks for {range:?}",
                    node.blocks.len()
                ));
            }
            held += node.blocks.len();
            for &b in &node.blocks {
                *refs.entry(b).or_default() += 1;
            }
            for (j, &t) in node.key.iter().enumerate() {
                let p = node.start + j;
                let b = node.blocks[p / bs - node.start / bs];
                if pool.tokens(b)[p % bs] != t {
                    return Err(format!("node {i}: {b} slot {} is not token {t}", p % bs));
                }
            }
            if node.parent != NIL {
                let parent = self.node(node.parent);
                if node.key.is_empty() || parent.children.get(&node.key[0]) != Some(&(i as u32)) {
                    return Err(format!(
                        "node {i} is not its parent's child under its first token"
                    ));
                }
                if node.start != parent.start + parent.key.len() {
                    return Err(format!(
                        "node {i} starts at {} after its parent's end",
                        node.start
                    ));
                }
                if parent.parent != NIL && node.lock > parent.lock {
                    return Err(format!("node {i} is locked more than its parent"));
                }
            }
            for &c in node.children.values() {
                if self
                    .nodes
                    .get(c as usize)
                    .and_then(Option::as_ref)
                    .map(|c| c.parent)
                    != Some(i as u32)
                {
                    return Err(format!("child {c} of node {i} does not point back"));
                }
            }
        }
        if held != self.held {
            return Err(format!("{held} references held, {} counted", self.held));
        }
        for (b, n) in refs {
            let count = pool.ref_count(b).map_err(|e| e.to_string())?;
            if count < n {
                return Err(format!(
                    "{b} has count {count} but the tree holds it {n} times"
                ));
            }
        }
        Ok(())
    }
}
