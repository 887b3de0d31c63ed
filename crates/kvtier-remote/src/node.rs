//! One server node: a bounded pool of connections and its reconnect backoff.
//!
//! A failure (connect refused, timeout, reset, a reply that does not parse) drops the connection
//! and every idle one (they are likely dead too: the server restarted), and puts the node in
//! backoff: it is not tried again for `reconnect_backoff_min`, doubling per consecutive failure
//! up to `reconnect_backoff_max`. Meanwhile its keys are misses at once, so a serving loop never
//! waits on a dead server for more than one connect or I/O timeout per backoff period. One
//! failure is not taken for a server down: a pooled connection the server closed while it sat
//! idle (end-of-file or a reset before any reply) is replaced and its exchange run again
//! ([`Node::run`]).

use std::io;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::{Credentials, Endpoint, RemoteConfig};
use crate::error::RemoteError;
use crate::metrics::{bump, Counters};
use crate::resp::{Conn, Reply};
use crate::tls::{is_tls_error, TlsClient};

#[derive(Debug, Default)]
struct NodeState {
    idle: Vec<Conn>,
    /// Connections out of the pool or idle (never above `connections_per_node_max`).
    open: usize,
    down_until: Option<Instant>,
    backoff: Duration,
    /// A connection failed since the last successful connect (the next success is a reconnect).
    failed: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

/// What a node needs to open connections.
#[derive(Clone, Debug)]
pub(crate) struct ConnectSettings {
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    pub connections_max: usize,
    pub credentials: Credentials,
    pub db: u32,
    pub tls: Option<TlsClient>,
}

impl ConnectSettings {
    pub fn new(config: &RemoteConfig, credentials: Credentials, db: u32, tls: Option<TlsClient>) -> Self {
        ConnectSettings {
            connect_timeout: config.connect_timeout,
            io_timeout: config.io_timeout,
            backoff_min: config.reconnect_backoff_min,
            backoff_max: config.reconnect_backoff_max,
            connections_max: config.connections_per_node_max,
            credentials,
            db,
            tls,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Node {
    pub endpoint: Endpoint,
    state: Mutex<NodeState>,
    returned: Condvar,
}

impl Node {
    pub fn new(endpoint: Endpoint) -> Self {
        Node { endpoint, state: Mutex::new(NodeState::default()), returned: Condvar::new() }
    }

    pub fn is_down(&self) -> bool {
        self.state.lock().down_until.is_some_and(|t| t > Instant::now())
    }

    /// A connection from the pool, or a new one; `Err(Down)` while in backoff.
    pub fn checkout(&self, s: &ConnectSettings, counters: &Counters) -> Result<Conn, RemoteError> {
        let deadline = Instant::now() + s.io_timeout;
        let mut st = self.state.lock();
        loop {
            if let Some(conn) = st.idle.pop() {
                return Ok(conn);
            }
            let now = Instant::now();
            if let Some(until) = st.down_until.filter(|&t| t > now) {
                return Err(RemoteError::Down {
                    endpoint: self.endpoint.to_string(),
                    retry_in_ms: (until - now).as_millis() as u64,
                });
            }
            if st.open < s.connections_max {
                st.open += 1;
                drop(st);
                return match self.open(s) {
                    Ok(conn) => {
                        let mut st = self.state.lock();
                        bump(&counters.connects, 1);
                        if st.failed {
                            bump(&counters.reconnects, 1);
                            st.failed = false;
                        }
                        st.down_until = None;
                        st.backoff = Duration::ZERO;
                        Ok(conn)
                    }
                    Err(e) => {
                        if matches!(e, RemoteError::Auth { .. } | RemoteError::Tls { .. }) {
                            bump(&counters.auth_failures, 1);
                        }
                        bump(&counters.connect_failures, 1);
                        let mut st = self.state.lock();
                        st.open -= 1;
                        self.mark_down(&mut st, s);
                        Err(e)
                    }
                };
            }
            if self.returned.wait_until(&mut st, deadline).timed_out() {
                return Err(RemoteError::Io {
                    endpoint: self.endpoint.to_string(),
                    reason: format!("all {} connections busy for {:?}", s.connections_max, s.io_timeout),
                });
            }
        }
    }

    /// Runs `exchange` on a connection of this node: checked in again after `Ok`, discarded
    /// (the node backing off) after `Err`; `Err(RemoteError)` if no connection could be had.
    /// A pooled connection the server closed while it sat idle (its `timeout`, a proxy's idle
    /// limit, `CLIENT KILL`) fails at once with end-of-file or a reset, before any reply: then
    /// `exchange` runs once more on a new connection, and the node does not back off for it (the
    /// server is not known to be down). `exchange` must be safe to run twice when the server
    /// answered none of the first run (every caller's commands are idempotent or `SET NX`).
    pub fn run<R>(
        &self,
        s: &ConnectSettings,
        counters: &Counters,
        mut exchange: impl FnMut(&mut Conn) -> io::Result<R>,
    ) -> Result<io::Result<R>, RemoteError> {
        let mut conn = self.checkout(s, counters)?;
        let before = conn.lines_read;
        let mut result = exchange(&mut conn);
        if matches!(&result, Err(e) if closed_by_server(e)) && conn.lines_read == before {
            self.drop_closed(conn);
            conn = self.checkout(s, counters)?;
            result = exchange(&mut conn);
        }
        match &result {
            Ok(_) => self.checkin(conn),
            Err(_) => self.discard(conn, s),
        }
        Ok(result)
    }

    /// Drops a connection the server closed while it sat idle, and the other idle ones (they sat
    /// as long: the pool hands out the most recently used first), without a backoff.
    fn drop_closed(&self, conn: Conn) {
        drop(conn);
        let mut st = self.state.lock();
        let idle = std::mem::take(&mut st.idle);
        st.open -= 1 + idle.len();
        drop(st);
        drop(idle);
        self.returned.notify_all();
    }

    /// Returns a healthy connection to the pool.
    pub fn checkin(&self, conn: Conn) {
        self.state.lock().idle.push(conn);
        self.returned.notify_one();
    }

    /// Drops a failed connection (and the idle ones) and starts or extends the backoff.
    pub fn discard(&self, conn: Conn, s: &ConnectSettings) {
        drop(conn);
        let mut st = self.state.lock();
        st.open -= 1;
        let idle = std::mem::take(&mut st.idle);
        st.open -= idle.len();
        self.mark_down(&mut st, s);
        drop(st);
        drop(idle);
        self.returned.notify_all();
    }

    fn mark_down(&self, st: &mut NodeState, s: &ConnectSettings) {
        st.failed = true;
        st.backoff = if st.backoff.is_zero() { s.backoff_min } else { (st.backoff * 2).min(s.backoff_max) };
        st.down_until = Some(Instant::now() + st.backoff);
    }

    /// Opens and authenticates one connection; `Err(Auth)` when the server refuses the
    /// credentials or demands some that were not given.
    fn open(&self, s: &ConnectSettings) -> Result<Conn, RemoteError> {
        let endpoint = self.endpoint.to_string();
        let io = |e: std::io::Error| RemoteError::Io { endpoint: endpoint.clone(), reason: e.to_string() };
        let host = &self.endpoint.host;
        let conn = Conn::connect(host, self.endpoint.port, s.connect_timeout, s.io_timeout, s.tls.as_ref());
        let mut conn = conn.map_err(|e| {
            if is_tls_error(&e) {
                RemoteError::Tls { endpoint: endpoint.clone(), reason: e.to_string() }
            } else {
                io(e)
            }
        })?;
        // The whole handshake (AUTH, SELECT, PING) within one io_timeout.
        conn.set_limit(Some(std::time::Instant::now() + s.io_timeout));
        let user = s.credentials.username.clone().unwrap_or_else(|| "default".to_string());
        if let Some(password) = &s.credentials.password {
            let mut args: Vec<&[u8]> = vec![b"AUTH"];
            if let Some(u) = &s.credentials.username {
                args.push(u.as_bytes());
            }
            args.push(password.as_bytes());
            conn.write_command(&args).map_err(io)?;
        }
        if s.db != 0 {
            let db = s.db.to_string();
            conn.write_command(&[b"SELECT", db.as_bytes()]).map_err(io)?;
        }
        conn.write_command(&[b"PING"]).map_err(io)?;
        conn.flush().map_err(io)?;
        let replies = 1 + usize::from(s.credentials.password.is_some()) + usize::from(s.db != 0);
        for _ in 0..replies {
            match conn.read_reply().map_err(io)? {
                Reply::Status(_) => {}
                Reply::Error(e)
                    if e.starts_with("WRONGPASS") || e.starts_with("NOAUTH") || e.contains("AUTH") =>
                {
                    let reply = if e.starts_with("NOAUTH") {
                        format!("{e} (the server needs a password; none was configured)")
                    } else {
                        e
                    };
                    return Err(RemoteError::Auth { endpoint, user, reply });
                }
                Reply::Error(e) if not_ready(&e) => {
                    // Up but not serving yet: down for now (a miss, not a configuration error).
                    return Err(RemoteError::Io { endpoint, reason: format!("server not ready: {e}") });
                }
                other => {
                    return Err(RemoteError::Protocol {
                        endpoint,
                        reason: format!("{other:?} during connection setup"),
                    })
                }
            }
        }
        conn.set_limit(None);
        Ok(conn)
    }
}

/// Whether an I/O error says the server closed the connection (end-of-file, a reset, a broken
/// pipe), rather than that it is slow (a timeout) or garbled (invalid data).
fn closed_by_server(e: &io::Error) -> bool {
    use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    matches!(e.kind(), UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe)
}

/// Whether an error reply to the handshake says the server is up but cannot serve yet: loading
/// its dataset after a restart (`LOADING`, minutes for a large one), running a script (`BUSY`), a
/// replica cut off from its master (`MASTERDOWN`), or at its client limit. The rest of the
/// handshake's errors (a database out of range, an ACL refusing `PING`) are settings to fix.
pub(crate) fn not_ready(error: &str) -> bool {
    ["LOADING", "BUSY", "MASTERDOWN", "ERR max number of clients"].iter().any(|p| error.starts_with(p))
}
