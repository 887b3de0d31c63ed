//! A minimal RESP2 client connection: just what the remote tier sends (GET, SET, EXISTS, DEL,
//! AUTH, SELECT, PING, CLUSTER SLOTS, and DBSIZE, SCAN, UNLINK to clear a namespace) and what it
//! reads back.
//!
//! Why our own and not the `redis` crate: a 4 MiB GET must land in the caller's buffer with no
//! intermediate copy (the reply's 64-byte object header goes to the stack, the payload is read
//! from the socket straight into the destination), and a SET must send header + payload without
//! first concatenating them. Both matter at 4 MiB; the protocol subset is ~200 lines.
//!
//! Untrusted input: every length read from the server is bounded before it is used; a reply
//! that does not parse is an `InvalidData` error and the connection is dropped.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::OBJECT_HEADER_BYTES;
use parking_lot::Mutex;

use crate::tls::{TlsClient, TlsStream};

/// Longest status/error line or integer line read: 64 KiB.
pub const LINE_BYTES_MAX: usize = 64 << 10;
/// Largest bulk string read into memory by [`Conn::read_reply`] (not GET payloads): 64 MiB.
pub const REPLY_BULK_BYTES_MAX: usize = 64 << 20;
/// Most elements of one array reply (CLUSTER SLOTS of a large cluster stays far below).
pub const REPLY_ARRAY_LEN_MAX: usize = 1 << 20;
/// What each reply item (an array element, a bulk string) counts against a
/// [`Conn::read_reply_within`] bound on top of its bytes.
pub const REPLY_ITEM_BYTES: usize = 16;
/// Deepest nesting of array replies.
pub const REPLY_DEPTH_MAX: usize = 8;
/// Socket buffer sizes of the client side (small commands coalesce; large values bypass them).
const BUF_BYTES: usize = 256 << 10;

/// A parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// How a GET reply into a caller buffer went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkInto {
    /// `dst` holds the value's bytes after the header (which `header` holds, when asked).
    Filled,
    /// The key does not exist.
    Nil,
    /// The value has another length than expected; it was read and discarded.
    WrongLength(u64),
    /// The server answered an error (e.g. `MOVED`, `CLUSTERDOWN`); see `Conn::last_error`.
    ServerError,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The stream under one side of a connection: a plain socket (cloned for reading and writing),
/// or a TLS stream both sides share (one thread uses a connection at a time, so the lock is
/// uncontended).
enum Stream {
    Tcp(TcpStream),
    Tls(Arc<Mutex<TlsStream>>),
}

/// One side of a connection, with the deadline of the exchange in progress: no system call may
/// block past it, so a server that trickles bytes cannot stretch one reply (or one write) past
/// `io_timeout`, however many reads it takes. The socket's own timeout is only lowered when what
/// is left of the deadline drops below it (to half of what is left, so an exchange costs a few
/// `setsockopt` calls at most, usually none); a call that times out before the deadline is retried.
struct Half {
    stream: Stream,
    /// The socket itself, to set its timeouts (a TLS stream owns its own handle).
    sock: TcpStream,
    reads: bool,
    deadline: Instant,
    /// The timeout the socket has now (`None`: unknown, set it before the next call).
    armed: Option<Duration>,
}

impl Half {
    fn arm(&mut self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let what = if self.reads { "a whole reply" } else { "a whole write" };
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no {what} within io_timeout")));
        }
        if self.armed.is_some_and(|a| a <= left) {
            return Ok(()); // a call now ends (or times out) before the deadline
        }
        let timeout = (left / 2).max(Duration::from_millis(1)).min(left);
        if self.reads {
            self.sock.set_read_timeout(Some(timeout))?;
        } else {
            self.sock.set_write_timeout(Some(timeout))?;
        }
        self.armed = Some(timeout);
        Ok(())
    }

    /// Runs one system call on the stream, armed; a socket timeout before the deadline (the
    /// socket's timeout is shorter than what is left) re-arms and calls again.
    fn call<T>(&mut self, mut f: impl FnMut(&mut Stream) -> io::Result<T>) -> io::Result<T> {
        loop {
            self.arm()?;
            match f(&mut self.stream) {
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    self.armed = None; // `arm` says whether the deadline has passed
                }
                r => return r,
            }
        }
    }
}

impl Read for Half {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.call(|stream| match stream {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.lock().read(buf),
        })
    }
}

impl Write for Half {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.call(|stream| match stream {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.lock().write(buf),
        })
    }

    fn flush(&mut self) -> io::Result<()> {
        self.call(|stream| match stream {
            Stream::Tcp(s) => s.flush(),
            Stream::Tls(s) => s.lock().flush(),
        })
    }
}

/// One connection to one server.
pub struct Conn {
    reader: BufReader<Half>,
    writer: BufWriter<Half>,
    line: Vec<u8>,
    /// The text of the last error reply read by [`read_bulk_into`](Self::read_bulk_into) or
    /// [`read_status`](Self::read_status).
    pub last_error: String,
    /// How long one reply (or one write call) may take, whole.
    io_timeout: Duration,
    /// An outer bound on every deadline (e.g. the whole connection handshake).
    limit: Option<Instant>,
    /// Reply lines read so far (only grows): whether the server answered since a given point.
    pub(crate) lines_read: u64,
    /// Cluster: send `ASKING` before each command of a pipeline ([`crate::pipeline`]).
    pub asking: bool,
    /// Cluster: the `ASK` redirections a pipeline got, `(item index, "host:port")`.
    pub asks: Vec<(usize, String)>,
}

impl Conn {
    /// Connects to `host:port` within `connect_timeout` (the name's lookup and the TCP connect
    /// to each of its addresses in turn, together), over TLS when `tls` is given (handshake
    /// completed here, within `io_timeout`).
    pub fn connect(
        host: &str,
        port: u16,
        connect_timeout: Duration,
        io_timeout: Duration,
        tls: Option<&TlsClient>,
    ) -> io::Result<Conn> {
        let stream = crate::dial::dial(host, port, connect_timeout)?;
        stream.set_nodelay(true)?;
        // Until the first exchange arms them: bounds the TLS handshake's reads.
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        let (read_sock, write_sock) = (stream.try_clone()?, stream.try_clone()?);
        let (read_half, write_half) = match tls {
            None => (Stream::Tcp(stream.try_clone()?), Stream::Tcp(stream)),
            Some(client) => {
                let shared = Arc::new(Mutex::new(crate::tls::wrap(client, host, stream)?));
                (Stream::Tls(shared.clone()), Stream::Tls(shared))
            }
        };
        let deadline = Instant::now() + io_timeout;
        let armed = Some(io_timeout);
        let read_half = Half { stream: read_half, sock: read_sock, reads: true, deadline, armed };
        let write_half = Half { stream: write_half, sock: write_sock, reads: false, deadline, armed };
        Ok(Conn {
            reader: BufReader::with_capacity(BUF_BYTES, read_half),
            writer: BufWriter::with_capacity(BUF_BYTES, write_half),
            line: Vec::with_capacity(256),
            last_error: String::new(),
            io_timeout,
            limit: None,
            lines_read: 0,
            asking: false,
            asks: Vec::new(),
        })
    }

    /// Bounds every later deadline by `limit` (`None`: no outer bound), e.g. a whole handshake.
    pub fn set_limit(&mut self, limit: Option<Instant>) {
        self.limit = limit;
    }

    fn deadline(&self) -> Instant {
        let d = Instant::now() + self.io_timeout;
        self.limit.map_or(d, |l| l.min(d))
    }

    /// Starts the clock of one reply: all of it must arrive within `io_timeout`.
    fn start_reply(&mut self) {
        self.reader.get_mut().deadline = self.deadline();
    }

    /// Starts the clock of one write call.
    fn start_write(&mut self) {
        self.writer.get_mut().deadline = self.deadline();
    }

    fn write_len(&mut self, tag: u8, n: usize) -> io::Result<()> {
        self.writer.write_all(&[tag])?;
        self.writer.write_all(itoa_buf(n).digits())?;
        self.writer.write_all(b"\r\n")
    }

    /// Writes one bulk string made of `pieces` (written in order, never concatenated).
    pub fn write_bulk(&mut self, pieces: &[&[u8]]) -> io::Result<()> {
        self.start_write();
        let len = pieces.iter().map(|p| p.len()).sum();
        self.write_len(b'$', len)?;
        for p in pieces {
            self.writer.write_all(p)?;
        }
        self.writer.write_all(b"\r\n")
    }

    /// Writes the array header of a command of `args` arguments.
    pub fn write_array_len(&mut self, args: usize) -> io::Result<()> {
        self.start_write();
        self.write_len(b'*', args)
    }

    /// Writes a command whose arguments are each one piece.
    pub fn write_command(&mut self, args: &[&[u8]]) -> io::Result<()> {
        self.write_array_len(args.len())?;
        for a in args {
            self.write_bulk(&[a])?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.start_write();
        self.writer.flush()
    }

    fn read_line(&mut self) -> io::Result<()> {
        self.line.clear();
        let n = (&mut self.reader).take(LINE_BYTES_MAX as u64).read_until(b'\n', &mut self.line)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "server closed the connection"));
        }
        if !self.line.ends_with(b"\r\n") {
            return Err(invalid(format!(
                "reply line longer than {LINE_BYTES_MAX} bytes or not CRLF-terminated"
            )));
        }
        self.line.truncate(self.line.len() - 2);
        self.lines_read += 1;
        Ok(())
    }

    fn line_text(&self) -> String {
        String::from_utf8_lossy(&self.line[1..]).into_owned()
    }

    fn line_int(&self) -> io::Result<i64> {
        std::str::from_utf8(&self.line[1..]).ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| {
            invalid(format!("bad integer in reply: {:?}", String::from_utf8_lossy(&self.line)))
        })
    }

    fn read_crlf(&mut self) -> io::Result<()> {
        let mut crlf = [0u8; 2];
        self.reader.read_exact(&mut crlf)?;
        if crlf != *b"\r\n" {
            return Err(invalid("bulk string not followed by CRLF".into()));
        }
        Ok(())
    }

    /// Reads and throws away `n` bytes (a value of the wrong size).
    fn discard(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            let available = self.reader.fill_buf()?;
            if available.is_empty() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "server closed the connection"));
            }
            let take = available.len().min(usize::try_from(n).unwrap_or(usize::MAX));
            self.reader.consume(take);
            n -= take as u64;
        }
        Ok(())
    }

    /// Reads one whole reply (small replies only: bulk strings up to [`REPLY_BULK_BYTES_MAX`]).
    pub fn read_reply(&mut self) -> io::Result<Reply> {
        self.read_reply_within(usize::MAX)
    }

    /// Reads one whole reply whose bulk strings and array elements add up to at most
    /// `bytes_max` (each element counts [`REPLY_ITEM_BYTES`] on top of its bytes): a reply
    /// of many items, such as a `SCAN` page, is bounded as a whole, not only item by item.
    pub fn read_reply_within(&mut self, bytes_max: usize) -> io::Result<Reply> {
        self.start_reply();
        let mut budget = bytes_max;
        self.read_reply_depth(0, &mut budget)
    }

    fn read_reply_depth(&mut self, depth: usize, budget: &mut usize) -> io::Result<Reply> {
        if depth > REPLY_DEPTH_MAX {
            return Err(invalid(format!("reply nested deeper than {REPLY_DEPTH_MAX}")));
        }
        *budget = budget
            .checked_sub(REPLY_ITEM_BYTES)
            .ok_or_else(|| invalid("reply larger than this command's bound".into()))?;
        self.read_line()?;
        match self.line.first() {
            Some(b'+') => Ok(Reply::Status(self.line_text())),
            Some(b'-') => Ok(Reply::Error(self.line_text())),
            Some(b':') => Ok(Reply::Int(self.line_int()?)),
            Some(b'$') => {
                let n = self.line_int()?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                if n > REPLY_BULK_BYTES_MAX || n > *budget {
                    return Err(invalid(format!(
                        "bulk reply of {n} bytes; at most {} read here",
                        REPLY_BULK_BYTES_MAX.min(*budget)
                    )));
                }
                *budget -= n;
                let mut v = vec![0u8; n];
                self.reader.read_exact(&mut v)?;
                self.read_crlf()?;
                Ok(Reply::Bulk(Some(v)))
            }
            Some(b'*') => {
                let n = self.line_int()?;
                if n < 0 {
                    return Ok(Reply::Array(None));
                }
                let n = usize::try_from(n).unwrap_or(usize::MAX);
                if n > REPLY_ARRAY_LEN_MAX {
                    return Err(invalid(format!("array reply of {n} items; at most {REPLY_ARRAY_LEN_MAX}")));
                }
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    items.push(self.read_reply_depth(depth + 1, budget)?);
                }
                Ok(Reply::Array(Some(items)))
            }
            _ => Err(invalid(format!("unknown reply type in {:?}", String::from_utf8_lossy(&self.line)))),
        }
    }

    /// Reads a GET reply's first line: `Ok(Ok(bytes to follow))`, or `Ok(Err(Nil | ServerError))`.
    fn read_bulk_len(&mut self) -> io::Result<Result<u64, BulkInto>> {
        self.start_reply();
        self.read_line()?;
        match self.line.first() {
            Some(b'$') => {}
            Some(b'-') => {
                self.last_error = self.line_text();
                return Ok(Err(BulkInto::ServerError));
            }
            _ => {
                return Err(invalid(format!(
                    "expected a bulk string, got {:?}",
                    String::from_utf8_lossy(&self.line[..self.line.len().min(64)])
                )))
            }
        }
        let n = self.line_int()?;
        Ok(if n < 0 { Err(BulkInto::Nil) } else { Ok(n as u64) })
    }

    /// Reads a bulk-string reply of expected length `header.len() + dst.len()` straight into
    /// `header` then `dst` (no intermediate buffer).
    pub fn read_bulk_into(&mut self, header: &mut [u8], dst: &mut [u8]) -> io::Result<BulkInto> {
        let n = match self.read_bulk_len()? {
            Ok(n) => n,
            Err(outcome) => return Ok(outcome),
        };
        if n != (header.len() + dst.len()) as u64 {
            self.discard(n)?;
            self.read_crlf()?;
            return Ok(BulkInto::WrongLength(n));
        }
        self.reader.read_exact(header)?;
        self.reader.read_exact(dst)?;
        self.read_crlf()?;
        Ok(BulkInto::Filled)
    }

    /// Reads a bulk-string reply of at most `bytes_max` bytes whole: `Ok(Ok(value))`, or `Ok(Err(
    /// Nil | ServerError | WrongLength))`, the last for a longer value, discarded unstored.
    pub fn read_bulk_whole(&mut self, bytes_max: usize) -> io::Result<Result<Vec<u8>, BulkInto>> {
        let n = match self.read_bulk_len()? {
            Ok(n) => n,
            Err(outcome) => return Ok(Err(outcome)),
        };
        if n > bytes_max as u64 {
            self.discard(n)?;
            self.read_crlf()?;
            return Ok(Err(BulkInto::WrongLength(n)));
        }
        let mut value = vec![0u8; n as usize];
        self.reader.read_exact(&mut value)?;
        self.read_crlf()?;
        Ok(Ok(value))
    }

    /// Reads a reply to SET/AUTH/SELECT/PING: `Ok(Some(true))` for a status, `Ok(Some(false))`
    /// for nil (SET NX on an existing key), `Ok(None)` for an error reply (in `last_error`).
    pub fn read_status(&mut self) -> io::Result<Option<bool>> {
        match self.read_reply()? {
            Reply::Status(_) => Ok(Some(true)),
            Reply::Bulk(None) | Reply::Array(None) => Ok(Some(false)),
            Reply::Error(e) => {
                self.last_error = e;
                Ok(None)
            }
            other => Err(invalid(format!("expected a status reply, got {other:?}"))),
        }
    }
}

/// Decimal digits of a `usize` without allocating.
struct ItoaBuf {
    buf: [u8; 20],
    start: usize,
}

impl ItoaBuf {
    fn digits(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

fn itoa_buf(mut n: usize) -> ItoaBuf {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    ItoaBuf { buf, start: i }
}

/// Bytes of the kvtier object header that precedes every remote value's payload.
pub const HEADER_BYTES: usize = OBJECT_HEADER_BYTES;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn itoa() {
        for n in [0usize, 7, 10, 4194368, usize::MAX] {
            assert_eq!(itoa_buf(n).digits(), n.to_string().as_bytes());
        }
    }
}
