//! Opening a TCP connection to a server within the connect timeout: the host name's lookup and
//! the connects to each of its addresses share it.
//!
//! `getaddrinfo` has no timeout of its own: a resolver that does not answer blocks its caller for
//! as long as resolv.conf's attempts take (tens of seconds), and a connection is opened on a
//! thread serving a load. So an IP address is parsed without a lookup, and a name is looked up
//! on a thread of its own that the caller waits for at most the timeout. A lookup still running
//! then is left to finish on its own (its answer is dropped), and the connection attempt fails
//! with `TimedOut`, as a connect past the timeout does: the node is marked down for its backoff.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

/// A TCP connection to `host:port` within `timeout` (the lookup and a connect to each address in
/// turn, together); the error is the last address's, or `TimedOut`.
pub(crate) fn dial(host: &str, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} resolves to no address"));
    for addr in resolve(host, port, timeout)? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {host} timed out")));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The addresses of `host:port`, by the system resolver, within `timeout`.
pub(crate) fn resolve(host: &str, port: u16, timeout: Duration) -> io::Result<Vec<SocketAddr>> {
    resolve_with(host, port, timeout, |name, port| Ok((name, port).to_socket_addrs()?.collect()))
}

/// [`resolve`] with `lookup` for the system resolver (tests give one that never answers).
fn resolve_with<F>(host: &str, port: u16, timeout: Duration, lookup: F) -> io::Result<Vec<SocketAddr>>
where
    F: FnOnce(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + 'static,
{
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (answer, answered) = mpsc::channel();
    let name = host.to_string();
    std::thread::Builder::new().name("kvtier-resolve".into()).spawn(move || {
        // The receiver is gone when the caller stopped waiting: the answer is dropped.
        let _ = answer.send(lookup(&name, port));
    })?;
    match answered.recv_timeout(timeout) {
        Ok(addresses) => addresses,
        Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("looking up {host} took longer than the connect timeout ({timeout:?})"),
        )),
        Err(RecvTimeoutError::Disconnected) => {
            Err(io::Error::other(format!("looking up {host} ended without an answer (the lookup panicked)")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn an_ip_address_needs_no_lookup() {
        let never = |_: &str, _: u16| -> io::Result<Vec<SocketAddr>> { panic!("looked up an IP address") };
        let got = resolve_with("127.0.0.1", 6379, Duration::from_secs(1), never).unwrap();
        assert_eq!(got, vec!["127.0.0.1:6379".parse().unwrap()]);
        let got = resolve_with("::1", 6380, Duration::from_secs(1), never).unwrap();
        assert_eq!(got, vec!["[::1]:6380".parse().unwrap()]);
    }

    #[test]
    fn a_lookup_that_never_answers_times_out() {
        // The lookup blocks until the test ends it: a caller that waited for it would hang here.
        let (end, ended) = mpsc::channel::<()>();
        let ended = Arc::new(Mutex::new(ended));
        let hung = move |_: &str, _: u16| -> io::Result<Vec<SocketAddr>> {
            let _ = ended.lock().unwrap().recv();
            Ok(vec!["10.0.0.1:6379".parse().unwrap()])
        };
        let err = resolve_with("redis.example", 6379, Duration::from_millis(50), hung).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("looking up redis.example took longer"), "{err}");
        end.send(()).unwrap();
    }

    #[test]
    fn a_lookup_error_or_panic_is_the_error() {
        let refused = |_: &str, _: u16| -> io::Result<Vec<SocketAddr>> {
            Err(io::Error::new(io::ErrorKind::NotFound, "no such host"))
        };
        let err = resolve_with("nowhere.example", 1, Duration::from_secs(5), refused).unwrap_err();
        assert_eq!((err.kind(), err.to_string()), (io::ErrorKind::NotFound, "no such host".to_string()));
        let panics = |_: &str, _: u16| -> io::Result<Vec<SocketAddr>> { panic!("resolver bug") };
        let err = resolve_with("nowhere.example", 1, Duration::from_secs(5), panics).unwrap_err();
        assert!(err.to_string().contains("ended without an answer"), "{err}");
    }

    #[test]
    fn dial_connects_to_a_listener_and_names_a_refusal() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stream = dial("localhost", port, Duration::from_secs(5)).unwrap();
        assert_eq!(stream.peer_addr().unwrap().port(), port);
        drop(listener);
        let err = dial("127.0.0.1", port, Duration::from_secs(5)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    }

    #[test]
    fn localhost_resolves_by_the_system_resolver() {
        let got = resolve("localhost", 6379, Duration::from_secs(5)).unwrap();
        assert!(!got.is_empty() && got.iter().all(|a| a.port() == 6379 && a.ip().is_loopback()), "{got:?}");
    }
}
