//! Topology: `nodes x gpus_per_node` ranks, numbered node-major (`rank = node * gpus_per_node + local`).
//! A node is an NVSwitch / copy-engine domain; ranks on different nodes talk only over the rail (NCCL).
//! Every `Topology` has at least one rank and a rank count that fits in `usize` (`new` checks the
//! product), so `world` never wraps: 768614336404564651 x 24 is refused, not taken for 8 ranks.

use crate::error::{Result, TideError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    pub nodes: usize,
    pub gpus_per_node: usize,
}

impl Topology {
    pub fn new(nodes: usize, gpus_per_node: usize) -> Result<Topology> {
        if nodes == 0 || gpus_per_node == 0 {
            return Err(TideError::InvalidTopology(format!(
                "{nodes}x{gpus_per_node}: nodes and gpus_per_node must be at least 1"
            )));
        }
        if nodes.checked_mul(gpus_per_node).is_none() {
            return Err(TideError::InvalidTopology(format!(
                "{nodes}x{gpus_per_node}: the number of ranks overflows"
            )));
        }
        Ok(Topology {
            nodes,
            gpus_per_node,
        })
    }
    /// Every rank on one node.
    pub fn single_node(world: usize) -> Topology {
        Topology {
            nodes: 1,
            gpus_per_node: world.max(1),
        }
    }
    /// Parses "2x4" (nodes x gpus_per_node), as in TIDE_TOPOLOGY.
    pub fn parse(s: &str) -> Result<Topology> {
        let bad = || TideError::InvalidTopology(format!("{s:?}: expected NODESxGPUS, e.g. 2x4"));
        let (a, b) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
        let nodes = a.trim().parse().map_err(|_| bad())?;
        let gpus = b.trim().parse().map_err(|_| bad())?;
        Topology::new(nodes, gpus)
    }
    /// nodes * gpus_per_node (saturating, for a `Topology` built field by field).
    pub fn world(&self) -> usize {
        self.nodes.saturating_mul(self.gpus_per_node)
    }
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.gpus_per_node
    }
    pub fn local_of(&self, rank: usize) -> usize {
        rank % self.gpus_per_node
    }
    /// The ranks of `rank`'s node (the ranks that share its copy-engine domain and memory).
    pub fn node_ranks(&self, rank: usize) -> std::ops::Range<usize> {
        let g = self.gpus_per_node.max(1);
        let node = rank / g;
        node * g..(node + 1) * g
    }
    pub fn rank(&self, node: usize, local: usize) -> usize {
        node * self.gpus_per_node + local
    }
    pub fn check_world(&self, world: usize) -> Result<()> {
        if self.nodes.checked_mul(self.gpus_per_node) != Some(world) {
            return Err(TideError::InvalidTopology(format!(
                "{}x{} has {} ranks but the group has world size {world}",
                self.nodes,
                self.gpus_per_node,
                self.world()
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.nodes, self.gpus_per_node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_never_wrap() {
        // 768614336404564651 * 24 = 8 (mod 2^64): once taken for an 8-rank topology.
        let nodes = 768_614_336_404_564_651usize;
        assert!(Topology::new(nodes, 24).is_err());
        assert!(Topology::parse("768614336404564651x24").is_err());
        let hand_built = Topology {
            nodes,
            gpus_per_node: 24,
        };
        assert!(hand_built.check_world(8).is_err());
        assert_eq!(hand_built.world(), usize::MAX);
        assert_eq!(Topology::new(2, 4).unwrap().world(), 8);
        Topology::parse("2x4").unwrap().check_world(8).unwrap();
    }
}
