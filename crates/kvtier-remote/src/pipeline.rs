//! Pipelined batches on one connection: send commands ahead of their replies, bounded by a
//! window (bytes for values, commands for small ones), and read each reply as it comes. A
//! sliding window keeps the server busy while the client reads (and, for GET, verifies).
//!
//! Each function fills `out[i]` for the items it got a reply for; on an I/O error it returns
//! it, leaving the remaining items [`Res::Failed`], and the caller drops the connection.

use std::io;

use kvtier_core::object::CODEC_RAW;
use kvtier_core::ObjectHeader;

use crate::resp::{BulkInto, Conn, Reply, HEADER_BYTES, REPLY_BULK_BYTES_MAX};

/// Most small commands (EXISTS, DEL) sent ahead of their replies.
pub const SMALL_COMMANDS_INFLIGHT_MAX: u64 = 4096;

/// What one item of a batch got back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Res {
    /// No reply (connection failed or node down).
    Failed,
    /// EXISTS: present or not; SET: stored (true) or already there (false, with NX); DEL: removed.
    Bool(bool),
    /// GET: the value was read into the caller's buffers.
    Filled,
    /// GET: no such key.
    Nil,
    /// GET: a value of another length than a kvtier object of this block size (discarded).
    WrongLength,
    /// Cluster: `MOVED`/`ASK`/`TRYAGAIN`: the slot lives elsewhere now.
    Redirect,
    /// `WRONGTYPE`: the key holds another kind of value (a list, a hash): not a kvtier object.
    WrongType,
    /// Any other error reply (e.g. `CLUSTERDOWN`, `OOM`).
    ServerError,
}

/// What the error reply in `c.last_error` to item `i` of a batch means; an `ASK` (its slot is
/// migrating and the key has moved) also records the master to ask, `host:port`, in `c.asks`.
fn error_res(c: &mut Conn, i: usize) -> Res {
    let target =
        c.last_error.strip_prefix("ASK ").and_then(|rest| rest.split(' ').nth(1)).map(str::to_string);
    if let Some(target) = target {
        c.asks.push((i, target));
    }
    classify_error(&c.last_error)
}

fn classify_error(e: &str) -> Res {
    if e.starts_with("MOVED") || e.starts_with("ASK") || e.starts_with("TRYAGAIN") {
        Res::Redirect
    } else if e.starts_with("WRONGTYPE") {
        Res::WrongType
    } else {
        Res::ServerError
    }
}

/// Sends `n` commands with `send`, reading replies with `recv`, keeping the cost of commands
/// sent and not yet answered at most `max` (but always at least one command in flight). With
/// `conn.asking`, each command is preceded by `ASKING` (the next command may touch a key of a
/// slot this master is importing), whose `+OK` is read before the command's reply.
fn sliding(
    conn: &mut Conn,
    n: usize,
    cost: impl Fn(usize) -> u64,
    max: u64,
    mut send: impl FnMut(&mut Conn, usize) -> io::Result<()>,
    mut recv: impl FnMut(&mut Conn, usize) -> io::Result<()>,
) -> io::Result<()> {
    let (mut sent, mut read, mut inflight) = (0usize, 0usize, 0u64);
    while read < n {
        let mut wrote = false;
        while sent < n && (sent == read || inflight + cost(sent) <= max) {
            if conn.asking {
                conn.write_command(&[b"ASKING"])?;
            }
            send(conn, sent)?;
            inflight += cost(sent);
            sent += 1;
            wrote = true;
        }
        if wrote {
            conn.flush()?;
        }
        if conn.asking {
            match conn.read_reply()? {
                Reply::Status(_) => {}
                other => {
                    let reason = format!("ASKING answered {other:?}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, reason));
                }
            }
        }
        recv(conn, read)?;
        inflight -= cost(read);
        read += 1;
    }
    Ok(())
}

fn int_reply(conn: &mut Conn, i: usize) -> io::Result<Res> {
    Ok(match conn.read_reply()? {
        Reply::Int(v) => Res::Bool(v > 0),
        Reply::Error(e) => {
            conn.last_error = e;
            error_res(conn, i)
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected an integer, got {other:?}"),
            ))
        }
    })
}

/// `EXISTS name` per item.
pub fn exists(conn: &mut Conn, names: &[&[u8]], out: &mut [Res]) -> io::Result<()> {
    per_name(conn, b"EXISTS", names, out)
}

/// `DEL name` per item.
pub fn del(conn: &mut Conn, names: &[&[u8]], out: &mut [Res]) -> io::Result<()> {
    per_name(conn, b"DEL", names, out)
}

/// `UNLINK name` per item (as `DEL`, the memory is freed in the background).
pub fn unlink(conn: &mut Conn, names: &[&[u8]], out: &mut [Res]) -> io::Result<()> {
    per_name(conn, b"UNLINK", names, out)
}

/// `command name` per item, each answered by an integer.
fn per_name(conn: &mut Conn, command: &[u8], names: &[&[u8]], out: &mut [Res]) -> io::Result<()> {
    sliding(
        conn,
        names.len(),
        |_| 1,
        SMALL_COMMANDS_INFLIGHT_MAX,
        |c, i| c.write_command(&[command, names[i]]),
        |c, i| {
            out[i] = int_reply(c, i)?;
            Ok(())
        },
    )
}

/// One GET of a batch: the value's first `header.len()` bytes go to `header` (when
/// `with_header`), the rest straight into `dst`.
pub struct GetItem<'a> {
    pub with_header: bool,
    pub header: [u8; HEADER_BYTES],
    pub dst: &'a mut [u8],
}

impl GetItem<'_> {
    fn value_len(&self) -> u64 {
        (self.dst.len() + if self.with_header { HEADER_BYTES } else { 0 }) as u64
    }
}

/// `GET name` per item, each value read straight into its [`GetItem`].
pub fn get(
    conn: &mut Conn,
    names: &[&[u8]],
    items: &mut [GetItem<'_>],
    inflight_bytes_max: u64,
    out: &mut [Res],
) -> io::Result<()> {
    let sizes: Vec<u64> = items.iter().map(GetItem::value_len).collect();
    sliding(
        conn,
        names.len(),
        |i| sizes[i],
        inflight_bytes_max,
        |c, i| c.write_command(&[b"GET", names[i]]),
        |c, i| {
            let item = &mut items[i];
            let header: &mut [u8] = if item.with_header { &mut item.header } else { &mut [] };
            out[i] = match c.read_bulk_into(header, item.dst)? {
                BulkInto::Filled => Res::Filled,
                BulkInto::Nil => Res::Nil,
                BulkInto::WrongLength(_) => Res::WrongLength,
                BulkInto::ServerError => error_res(c, i),
            };
            Ok(())
        },
    )
}

/// `GET name` per item, each whole value of at most `value_bytes_max` bytes into `values[i]`
/// (a longer one is [`Res::WrongLength`], discarded): each counts `value_bytes_max` bytes in the
/// window of `inflight_bytes_max`; with `value_bytes_max` 0 (sizes unknown), values up to
/// [`REPLY_BULK_BYTES_MAX`] are read, at most [`SMALL_COMMANDS_INFLIGHT_MAX`] commands in flight.
pub fn get_whole(
    conn: &mut Conn,
    names: &[&[u8]],
    values: &mut [Option<Vec<u8>>],
    value_bytes_max: u64,
    inflight_bytes_max: u64,
    out: &mut [Res],
) -> io::Result<()> {
    let (cost, max, bytes_max) = if value_bytes_max == 0 {
        (1, SMALL_COMMANDS_INFLIGHT_MAX, REPLY_BULK_BYTES_MAX)
    } else {
        let bytes_max = usize::try_from(value_bytes_max).unwrap_or(usize::MAX);
        (value_bytes_max, inflight_bytes_max, bytes_max)
    };
    sliding(
        conn,
        names.len(),
        |_| cost,
        max,
        |c, i| c.write_command(&[b"GET", names[i]]),
        |c, i| {
            out[i] = match c.read_bulk_whole(bytes_max)? {
                Ok(value) => {
                    values[i] = Some(value);
                    Res::Filled
                }
                Err(BulkInto::Nil) => Res::Nil,
                Err(BulkInto::WrongLength(_)) => Res::WrongLength,
                Err(BulkInto::ServerError | BulkInto::Filled) => error_res(c, i),
            };
            Ok(())
        },
    )
}

/// The 64-byte kvtier header that precedes a SET value's payload.
#[derive(Clone, Copy, Debug)]
pub enum HeaderSpec {
    /// A plain value (the raw-client baseline, tools).
    None,
    /// Already encoded (e.g. from a DRAM victim's stored checksum).
    Known([u8; HEADER_BYTES]),
    /// Encoded when the item is sent: the payload checksum is computed then, so hashing one
    /// object overlaps the server storing the ones before it.
    Compute { namespace: u128, key: u128 },
}

/// One SET of a batch: header (if any) and payload, sent back to back as one value.
#[derive(Clone, Copy, Debug)]
pub struct SetItem<'a> {
    pub header: HeaderSpec,
    pub payload: &'a [u8],
}

impl SetItem<'_> {
    pub fn value_len(&self) -> u64 {
        let header = if matches!(self.header, HeaderSpec::None) { 0 } else { HEADER_BYTES };
        (header + self.payload.len()) as u64
    }

    fn header_bytes(&self) -> Option<[u8; HEADER_BYTES]> {
        match self.header {
            HeaderSpec::None => None,
            HeaderSpec::Known(h) => Some(h),
            HeaderSpec::Compute { namespace, key } => {
                Some(ObjectHeader::for_payload(namespace, key, CODEC_RAW, self.payload).encode())
            }
        }
    }
}

/// `SET name <header><payload> [NX] [EX ttl_s]` per item.
pub fn set(
    conn: &mut Conn,
    names: &[&[u8]],
    items: &[SetItem<'_>],
    nx: bool,
    ttl_s: Option<u64>,
    inflight_bytes_max: u64,
    out: &mut [Res],
) -> io::Result<()> {
    let ttl = ttl_s.map(|t| t.to_string());
    let args = 3 + usize::from(nx) + if ttl.is_some() { 2 } else { 0 };
    sliding(
        conn,
        names.len(),
        |i| items[i].value_len(),
        inflight_bytes_max,
        |c, i| {
            c.write_array_len(args)?;
            c.write_bulk(&[b"SET"])?;
            c.write_bulk(&[names[i]])?;
            match items[i].header_bytes() {
                Some(h) => c.write_bulk(&[&h, items[i].payload])?,
                None => c.write_bulk(&[items[i].payload])?,
            }
            if nx {
                c.write_bulk(&[b"NX"])?;
            }
            if let Some(t) = &ttl {
                c.write_bulk(&[b"EX"])?;
                c.write_bulk(&[t.as_bytes()])?;
            }
            Ok(())
        },
        |c, i| {
            out[i] = match c.read_status()? {
                Some(stored) => Res::Bool(stored),
                None => error_res(c, i),
            };
            Ok(())
        },
    )
}
