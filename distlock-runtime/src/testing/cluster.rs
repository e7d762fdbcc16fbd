//! A Redis Cluster assembled through the servers' own commands.

use std::io;
use std::sync::Arc;

use super::{Network, RedisServer, TestCertificates, wait_for};

impl RedisServer {
    /// Starts a Redis Cluster of `masters` masters (at least 3) on free loopback ports, with
    /// every slot assigned (as `redis-cli --cluster create` would), and waits until it reports
    /// `cluster_state:ok` everywhere.
    pub fn start_cluster(masters: usize) -> io::Result<Vec<RedisServer>> {
        Self::start_cluster_with_replicas(masters, 0)
    }

    /// Like [`start_cluster`](Self::start_cluster), with `replicas` replicas per master, all
    /// synced before it returns (`CLUSTER NODES` tells which server has which role).
    ///
    /// The servers come back masters first, master `i` owning the `i`-th of `masters` even
    /// slot ranges (slots `i * 16384 / masters` up to the next master's first), then the
    /// replicas, the one at `masters + j` replicating master `j % masters`. Any number of
    /// masters from 3 works: `start_cluster_with_replicas(6, 1)` starts the 12 servers of a
    /// six-master Cluster with one replica each, as `bench -- --scale --cluster` does.
    pub fn start_cluster_with_replicas(
        masters: usize,
        replicas: usize,
    ) -> io::Result<Vec<RedisServer>> {
        Self::cluster_of(masters, replicas, None, None)
    }

    /// A cluster of `masters` masters whose nodes talk TLS to clients and to each other
    /// (`tls-cluster yes`), with the server certificate of `certs`: its nodes'
    /// [`url`](Self::url)s are `rediss://` ones, and the slot map names their TLS ports. The
    /// harness's own commands use the plain ports.
    pub fn start_cluster_tls(
        masters: usize,
        certs: &TestCertificates,
    ) -> io::Result<Vec<RedisServer>> {
        Self::cluster_of(masters, 0, Some(certs), None)
    }

    /// A cluster of fresh nodes: a few times over, as one may not come up (two nodes on one
    /// machine can meet on a busy cluster bus port, and never come up).
    pub(super) fn cluster_of(
        masters: usize,
        replicas: usize,
        certs: Option<&TestCertificates>,
        network: Option<&Arc<Network>>,
    ) -> io::Result<Vec<RedisServer>> {
        let mut last_error = None;
        for _ in 0..3 {
            match Self::try_cluster_of(masters, replicas, certs, network) {
                Ok(nodes) => return Ok(nodes),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("the cluster did not come up")))
    }

    fn try_cluster_of(
        masters: usize,
        replicas: usize,
        certs: Option<&TestCertificates>,
        network: Option<&Arc<Network>>,
    ) -> io::Result<Vec<RedisServer>> {
        let cluster_args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
        ]
        .map(str::to_owned);
        let nodes = (0..masters * (1 + replicas))
            .map(|_| match certs {
                None => Self::start_as(cluster_args.to_vec(), None, None, network),
                Some(certs) => {
                    let mut args = cluster_args.to_vec();
                    args.extend(["--tls-cluster", "yes"].map(str::to_owned));
                    Self::start_tls_with(certs, false, args)
                }
            })
            .collect::<io::Result<Vec<_>>>()?;
        Self::join_cluster(&nodes, masters)?;
        Self::wait_until_formed(&nodes, masters)?;
        Ok(nodes)
    }

    /// Waits until every node of `nodes` sees the cluster up and every replica (past the
    /// first `masters` nodes) has synced with its master.
    fn wait_until_formed(nodes: &[RedisServer], masters: usize) -> io::Result<()> {
        wait_for(
            || {
                nodes.iter().all(|n| {
                    n.command(&["CLUSTER", "INFO"])
                        .is_ok_and(|i| i.contains("cluster_state:ok"))
                })
            },
            "the cluster did not come up",
        )?;
        for replica in &nodes[masters..] {
            wait_for(
                || {
                    replica
                        .command(&["INFO", "replication"])
                        .is_ok_and(|info| info.contains("master_link_status:up"))
                },
                "a cluster replica did not sync",
            )?;
        }
        Ok(())
    }

    /// Makes `nodes` one cluster through the harness's own commands, as `redis-cli --cluster
    /// create` does, so that a lone server binary is enough: the first `masters` nodes share
    /// the 16384 slots in even ranges (each with a config epoch of its own), every node meets
    /// the first, and the others replicate the masters in turn.
    fn join_cluster(nodes: &[RedisServer], masters: usize) -> io::Result<()> {
        const SLOTS: usize = 16384;
        let expect_ok = |reply: String, what: &str| {
            if reply.starts_with('+') {
                Ok(())
            } else {
                Err(io::Error::other(format!("{what}: {reply}")))
            }
        };
        for (i, node) in nodes.iter().take(masters).enumerate() {
            let (first, last) = (i * SLOTS / masters, (i + 1) * SLOTS / masters - 1);
            let (first, last) = (first.to_string(), last.to_string());
            let reply = node.command(&["CLUSTER", "ADDSLOTSRANGE", &first, &last])?;
            expect_ok(reply, "CLUSTER ADDSLOTSRANGE")?;
            let epoch = (i + 1).to_string();
            expect_ok(
                node.command(&["CLUSTER", "SET-CONFIG-EPOCH", &epoch])?,
                "CLUSTER SET-CONFIG-EPOCH",
            )?;
        }
        let (first, others) = nodes
            .split_first()
            .ok_or_else(|| io::Error::other("no node"))?;
        for node in others {
            let port = node.tls_port.unwrap_or(node.port).to_string();
            expect_ok(
                first.command(&["CLUSTER", "MEET", &node.addr(), &port])?,
                "CLUSTER MEET",
            )?;
        }
        wait_for(
            || {
                nodes.iter().all(|n| {
                    n.command(&["CLUSTER", "NODES"])
                        .is_ok_and(|listing| listing.lines().count() == nodes.len())
                })
            },
            "the cluster's nodes did not meet",
        )?;
        for (j, replica) in nodes[masters..].iter().enumerate() {
            let id = nodes[j % masters].command(&["CLUSTER", "MYID"])?;
            expect_ok(
                replica.command(&["CLUSTER", "REPLICATE", id.trim()])?,
                "CLUSTER REPLICATE",
            )?;
        }
        Ok(())
    }
}
