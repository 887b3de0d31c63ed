//! A loopback `redis-server` / `valkey-server`, and a Redis Cluster of them, for the Rust test
//! suites (only with the `test-hooks` feature): the one harness the remote and store crates'
//! tests start servers with.
//!
//! Two ways a loopback server test used to fail at random, both closed here:
//! - a port picked with `bind(0)` lies in the kernel's ephemeral range, so an outgoing connection
//!   (any test's client) could take it before the server bound it; [`free_port`] picks ports
//!   outside that range (as `kvtier.testing.redis.free_port` does in Python);
//! - "the server is up" was a successful `connect`, but a connect to a not-yet-bound port in the
//!   ephemeral range can connect to itself (TCP simultaneous open); [`LoopbackServer`] waits for
//!   a real `PING` reply from the server instead.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::resp::{Conn, Reply};

/// `valkey-server` or `redis-server`, whichever is on PATH.
pub fn server_binary() -> Option<String> {
    ["valkey-server", "redis-server"].into_iter().map(String::from).find(|b| {
        Command::new(b).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
    })
}

/// [`server_binary`] for a test that needs a real server: panics, naming the fix, when there is
/// none (`make rust-test` installs one first); a test that passed without its server would not
/// have tested anything.
pub fn require_server_binary() -> String {
    server_binary().expect("no redis-server or valkey-server on PATH: `make redis` installs one")
}

fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|v| v.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

/// A loopback TCP port that was free a moment ago, outside the ephemeral range.
pub fn free_port() -> u16 {
    let (lo, hi) = ephemeral_range();
    let candidates: Vec<u16> = (10_000..lo).chain(hi.saturating_add(1)..=65_000).collect();
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id()).rotate_left(32);
    let mut x = seed | 1;
    for _ in 0..1000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17; // xorshift64
        let Some(&port) = candidates.get((x % candidates.len().max(1) as u64) as usize) else { break };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0").expect("a loopback port").local_addr().expect("its address").port()
}

/// A server on a loopback port, killed by pid on drop.
pub struct LoopbackServer {
    child: Option<Child>,
    pub port: u16,
    binary: String,
    password: Option<String>,
    /// Extra server arguments (cluster mode).
    args: Vec<String>,
}

impl LoopbackServer {
    /// Starts `binary` on `port` and waits until it answers `PING` (panics after 10 s).
    pub fn start(binary: &str, port: u16, password: Option<&str>) -> LoopbackServer {
        LoopbackServer::start_with(binary, port, password, &[])
    }

    /// As [`start`](Self::start), with extra server arguments (`--dir`, a loading delay, ...).
    /// A server still loading its dataset (`-LOADING` to `PING`) counts as started.
    pub fn start_with(binary: &str, port: u16, password: Option<&str>, args: &[&str]) -> LoopbackServer {
        let mut s = LoopbackServer {
            child: None,
            port,
            binary: binary.to_string(),
            password: password.map(String::from),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        s.restart();
        s
    }

    /// Starts a server on a fresh port, moving to another port when the picked one was taken
    /// before the server bound it.
    pub fn start_anywhere(binary: &str, password: Option<&str>) -> LoopbackServer {
        LoopbackServer::start_anywhere_with(binary, password, &[])
    }

    /// As [`start_anywhere`](Self::start_anywhere), with extra server arguments.
    pub fn start_anywhere_with(binary: &str, password: Option<&str>, args: &[&str]) -> LoopbackServer {
        for _ in 0..5 {
            let mut s = LoopbackServer {
                child: None,
                port: free_port(),
                binary: binary.to_string(),
                password: password.map(String::from),
                args: args.iter().map(|a| a.to_string()).collect(),
            };
            if s.try_start() {
                return s;
            }
        }
        panic!("{binary} did not start on any of 5 free ports");
    }

    /// (Re)starts the server on its port; panics if it does not answer within 10 s.
    pub fn restart(&mut self) {
        assert!(self.try_start(), "{} did not start on port {}", self.binary, self.port);
    }

    fn try_start(&mut self) -> bool {
        let mut cmd = Command::new(&self.binary);
        let port = self.port.to_string();
        cmd.args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        if let Some(p) = &self.password {
            cmd.args(["--requirepass", p]);
        }
        cmd.args(&self.args);
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn the server");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if answers_ping(self.port) {
                self.child = Some(child);
                return true;
            }
            if child.try_wait().ok().flatten().is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false; // exited (its port was taken) or never answered
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (by its pid); a later [`restart`](Self::restart) reuses the port.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill the server");
            c.wait().expect("reap the server");
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends one command on a fresh connection and returns its reply (setup and checks only).
    pub fn command(&self, args: &[&[u8]]) -> Reply {
        let second = Duration::from_secs(5);
        let mut conn = Conn::connect("127.0.0.1", self.port, second, second, None).expect("connect");
        if let Some(p) = &self.password {
            conn.write_command(&[b"AUTH", p.as_bytes()]).expect("send AUTH");
        }
        conn.write_command(args).expect("send the command");
        conn.flush().expect("send the command");
        if self.password.is_some() {
            conn.read_reply().expect("the AUTH reply");
        }
        conn.read_reply().expect("a reply")
    }
}

/// A Redis Cluster of `masters` loopback servers (no replicas), its slots split evenly, formed
/// with `CLUSTER ADDSLOTS` and `CLUSTER MEET`; every node killed and its directory removed on drop.
pub struct LoopbackCluster {
    pub nodes: Vec<LoopbackServer>,
    dir: PathBuf,
}

impl LoopbackCluster {
    /// Starts and forms the cluster; panics if it is not `cluster_state:ok` within 20 s.
    pub fn start(binary: &str, masters: usize) -> LoopbackCluster {
        let dir = std::env::temp_dir().join(format!("kvtier-cluster-{}-{}", std::process::id(), free_port()));
        let mut nodes = Vec::new();
        for i in 0..masters {
            let node_dir = dir.join(i.to_string());
            std::fs::create_dir_all(&node_dir).expect("a cluster node directory");
            nodes.push(start_cluster_node(binary, &node_dir));
        }
        let slots_per_node = crate::cluster::SLOTS.div_ceil(masters);
        for (i, node) in nodes.iter().enumerate() {
            let epoch = (i + 1).to_string();
            assert_eq!(node.command(&[b"CLUSTER", b"SET-CONFIG-EPOCH", epoch.as_bytes()]), ok());
            let slots: Vec<String> = (i * slots_per_node
                ..((i + 1) * slots_per_node).min(crate::cluster::SLOTS))
                .map(|s| s.to_string())
                .collect();
            let mut args: Vec<&[u8]> = vec![b"CLUSTER", b"ADDSLOTS"];
            args.extend(slots.iter().map(|s| s.as_bytes()));
            assert_eq!(node.command(&args), ok());
        }
        for node in &nodes[1..] {
            let port = node.port.to_string();
            assert_eq!(nodes[0].command(&[b"CLUSTER", b"MEET", b"127.0.0.1", port.as_bytes()]), ok());
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while !nodes.iter().all(|n| {
            let info = n.command(&[b"CLUSTER", b"INFO"]);
            matches!(info, Reply::Bulk(Some(b)) if String::from_utf8_lossy(&b).contains("cluster_state:ok"))
        }) {
            assert!(Instant::now() < deadline, "the cluster did not form within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        LoopbackCluster { nodes, dir }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(LoopbackServer::url).collect()
    }
}

impl Drop for LoopbackCluster {
    fn drop(&mut self) {
        self.nodes.clear(); // kills them
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ok() -> Reply {
    Reply::Status("OK".into())
}

/// A cluster-mode server in `dir` on a port whose cluster bus port (+10000) is free too.
fn start_cluster_node(binary: &str, dir: &std::path::Path) -> LoopbackServer {
    let (lo, _) = ephemeral_range();
    for _ in 0..20 {
        let port = free_port();
        // The bus port must be a valid port outside the ephemeral range, and free.
        let bus_free = port
            .checked_add(10_000)
            .is_some_and(|bus| bus < lo && TcpListener::bind(("127.0.0.1", bus)).is_ok());
        if !bus_free {
            continue;
        }
        let mut s = LoopbackServer {
            child: None,
            port,
            binary: binary.to_string(),
            password: None,
            args: ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir"]
                .into_iter()
                .map(String::from)
                .chain([dir.to_string_lossy().into_owned()])
                .collect(),
        };
        if s.try_start() {
            return s;
        }
    }
    panic!("{binary} did not start in cluster mode on any of 20 free port pairs");
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether a Redis server answers on `port` (`+PONG`, `-NOAUTH` when it wants a password, or
/// `-LOADING` while it loads its dataset): a self-connected socket or another program answers none.
fn answers_ping(port: u16) -> bool {
    let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
    if c.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    match c.read(&mut reply) {
        Ok(n) => [&b"+PONG"[..], b"-NOAUTH", b"-LOADIN"].iter().any(|p| reply[..n].starts_with(p)),
        Err(_) => false,
    }
}
