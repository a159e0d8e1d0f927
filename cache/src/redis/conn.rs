//! One handle over a single Redis server or a Redis Cluster.
//!
//! Both are built lazily: nothing is dialled until the first command, so the tier can be
//! created while Redis is down. A standalone server goes through redis-rs's
//! `ConnectionManager` (one multiplexed connection that reconnects by itself); a cluster through
//! its async cluster connection (one multiplexed connection per node, slot map refreshed on
//! MOVED). The tier still rebuilds the handle on every half-open probe of its breaker, so a
//! handle wedged in some unforeseen state cannot keep the service down.

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use ::redis::{Client, Cmd, FromRedisValue, RedisResult};

/// Knows how to dial Redis; cheap to call again.
#[derive(Clone)]
pub(crate) enum Connector {
    /// One server.
    Single(Client),
    /// A cluster, reached through any of its seed nodes (boxed: the client is large and
    /// the connector is cloned into every subscription).
    Cluster(Box<ClusterClient>),
}

/// A live (or lazily connecting) handle; clones share the underlying connection(s).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server.
    Single(ConnectionManager),
    /// A cluster.
    Cluster(ClusterConnection),
}

/// A master node of a cluster (or the only server), for commands that must visit every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Node {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Connector {
    /// Parses the urls without dialling anything.
    pub(crate) fn new(
        url: Option<&str>,
        cluster_urls: &[String],
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        if !cluster_urls.is_empty() {
            let client = ClusterClient::builder(cluster_urls.iter().map(String::as_str))
                .connection_timeout(connect_timeout)
                .response_timeout(response_timeout)
                // The breaker and the caller's fallback handle failures; long internal retry
                // loops would only hold requests past their deadline.
                .retries(2)
                .build()?;
            return Ok(Connector::Cluster(Box::new(client)));
        }
        match url {
            Some(url) => Ok(Connector::Single(Client::open(url)?)),
            None => Err((
                ::redis::ErrorKind::InvalidClientConfig,
                "neither url nor cluster_urls is set",
            )
                .into()),
        }
    }

    /// A handle that dials on first use. `response_timeout` bounds each reply (a blocking
    /// XREAD needs more than an ordinary command).
    pub(crate) fn connect(
        &self,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> RedisResult<Conn> {
        match self {
            Connector::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout))
                    // One dial per attempt: retrying inside the manager would hold the command
                    // beyond its deadline; the breaker decides when to try again.
                    .set_number_of_retries(0);
                let manager = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
                Ok(Conn::Single(manager))
            }
            Connector::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(connect_timeout)
                    .set_response_timeout(response_timeout);
                Ok(Conn::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
        }
    }
}

impl Conn {
    /// Runs one command (routed by its key on a cluster).
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Whether this is a cluster (keys of one script must then share a slot).
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }

    /// Runs one command on a given node (the only server when not a cluster).
    pub(crate) async fn query_node<T: FromRedisValue>(
        &self,
        node: Option<&Node>,
        cmd: Cmd,
    ) -> RedisResult<T> {
        match (self, node) {
            (Conn::Cluster(c), Some(node)) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: node.host.clone(),
                    port: node.port,
                });
                let value = c.clone().route_command(cmd, routing).await?;
                Ok(::redis::from_redis_value(value)?)
            }
            _ => self.query(&cmd).await,
        }
    }

    /// Every node a key-space scan must visit: the masters of a cluster (from `CLUSTER
    /// NODES`), or `[None]` for the single server.
    pub(crate) async fn scan_nodes(&self) -> RedisResult<Vec<Option<Node>>> {
        match self {
            Conn::Single(_) => Ok(vec![None]),
            Conn::Cluster(c) => {
                let value = c
                    .clone()
                    .route_command(
                        ::redis::cmd("CLUSTER").arg("NODES").clone(),
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                    )
                    .await?;
                let text: String = ::redis::from_redis_value(value)?;
                Ok(parse_masters(&text).into_iter().map(Some).collect())
            }
        }
    }
}

/// The reachable masters listed in a `CLUSTER NODES` reply.
///
/// Each line reads `<id> <ip:port@cport[,hostname]> <flags> <master> ...`; masters have
/// `master` among their flags, and those flagged `fail`, `noaddr` or `handshake` are skipped.
fn parse_masters(text: &str) -> Vec<Node> {
    let mut nodes = Vec::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_id), Some(addr), Some(flags)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let flags: Vec<&str> = flags.split(',').collect();
        if !flags.contains(&"master")
            || flags
                .iter()
                .any(|f| matches!(*f, "fail" | "noaddr" | "handshake"))
        {
            continue;
        }
        let hostport = addr.split(['@', ',']).next().unwrap_or_default();
        let Some((host, port)) = hostport.rsplit_once(':') else {
            continue;
        };
        let Ok(port) = port.parse() else { continue };
        if host.is_empty() {
            continue;
        }
        nodes.push(Node {
            host: host.to_string(),
            port,
        });
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masters_are_parsed_from_cluster_nodes() {
        let text = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@40003,host-c master - 0 1426238318243 3 connected 10923-16383
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
aaaa :0@0 master,noaddr - 0 0 1 disconnected
bbbb 127.0.0.1:30009@40009 master,fail - 0 0 1 disconnected
";
        let ports: Vec<u16> = parse_masters(text).iter().map(|n| n.port).collect();
        assert_eq!(ports, vec![30002, 30003, 30001]);
        assert!(parse_masters(text).iter().all(|n| n.host == "127.0.0.1"));
    }
}
